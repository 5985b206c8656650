"""The recipes as library code, one module each: its name, config section, objective, data and eval (base: the
Recipe class they subclass). recipes/<script>.py, the scripts users run, only call one's main. RECIPES is how
tools find them (their config classes: python -m llmtrain.data, the docs' and config tests)."""

from __future__ import annotations

from llmtrain.recipes.base import Recipe
from llmtrain.recipes.distill import Distill
from llmtrain.recipes.dpo import DPO
from llmtrain.recipes.grpo import GRPO
from llmtrain.recipes.kto import KTO
from llmtrain.recipes.reward import Reward
from llmtrain.recipes.sft import Finetune

RECIPES: dict[str, type[Recipe]] = {r.name: r for r in (Finetune, DPO, GRPO, Distill, Reward, KTO)}
