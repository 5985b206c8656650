"""Knowledge distillation (recipes/distill.py; docs/distill.md): config.py, the distill: section and the set-up
checks run before any process group; teacher.py, the teacher side (the teacher model beside the student, or its
stored top-k log-probs: their format, writer and readers, for python -m llmtrain.tools.distill_precompute);
objective.py, KDObjective (the student's KD + CE against the teacher side, chunk by chunk); recipe.py, the Distill
recipe (a Finetune with that objective, its offline or on-policy batch source, and its eval)."""

from llmtrain.recipes.distill.config import DistillConfig, DistillSection
from llmtrain.recipes.distill.recipe import Distill

__all__ = ["Distill", "DistillConfig", "DistillSection"]
