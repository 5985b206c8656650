"""The frozen-model component: a model beside the policy that takes no gradient and runs its own forward under
the policy's parallel strategy. DPO's and GRPO's reference (`reference`) and distillation's teacher
(`beside_policy`, or `standalone` for the teacher's precompute, which has no policy) are built here and used
through one call: `FrozenModel.forward(fn)` runs fn(model, token_loss) under no_grad in the model's own compute
dtype."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from llmtrain.config import ModelConfig, ParallelConfig
from llmtrain.distributed import DistEnv
from llmtrain.losses.token import TokenLoss
from llmtrain.models import lora
from llmtrain.models.build import BuiltModel, build_model
from llmtrain.train.build import Run


@dataclass
class FrozenModel:
    """built: the model (its parameters, plan and size); token_loss: its own TokenLoss (freed with it); kind: what
    it is, for the log ("frozen copy", "adapters off", "teacher"); off: a context around its forward (LoRA's
    adapters switched off, when the frozen model is the policy itself)."""
    built: BuiltModel
    token_loss: TokenLoss
    device: torch.device
    kind: str
    off: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    @property
    def model(self) -> torch.nn.Module:
        return self.built.model

    def autocast(self) -> contextlib.AbstractContextManager:
        """Its own compute dtype, on or off explicitly: it may run inside the policy's forward, whose autocast
        it must not inherit."""
        plan = self.built.plan
        return torch.autocast(self.device.type, dtype=plan.dtype, enabled=plan.autocast)

    def forward(self, fn: Callable[[torch.nn.Module, TokenLoss], object]) -> object:
        """fn(model, token_loss) under no_grad, in its compute dtype: what fn returns is never differentiable."""
        with torch.no_grad(), self.off(), self.autocast():
            return fn(self.model, self.token_loss)


def beside_policy(run: Run, source: ModelConfig, config, kind: str, dtype: torch.dtype | None = None,
                  loss_impl: str | None = None) -> FrozenModel:
    """`source`'s model (config: its transformers config), frozen next to the policy and sharded on its mesh
    (Strategy.frozen), computing in `dtype` (None: the policy's); its TokenLoss: train.loss_impl, or loss_impl."""
    cfg, env = run.cfg, run.env
    built = build_model(source, config, cfg.parallel, env, cfg.train.seed, frozen_next_to=run.policy,
                        frozen_dtype=dtype)
    token_loss = TokenLoss(loss_impl or cfg.train.loss_impl, built.model, env.device,
                           cfg.train.loss_chunk_tokens, env.sp_group)  # collective
    return FrozenModel(built, token_loss, env.device, kind)


def standalone(source: ModelConfig, config, parallel: ParallelConfig, env: DistEnv, seed: int, loss_impl: str,
               chunk_tokens: int, kind: str) -> FrozenModel:
    """`source`'s model with no policy beside it (a precompute): sharded by `parallel` itself, computing in its
    mixed_precision."""
    built = build_model(source, config, parallel, env, seed)
    built.model.requires_grad_(False)
    built.model.eval()
    return FrozenModel(built, TokenLoss(loss_impl, built.model, env.device, chunk_tokens), env.device, kind)


def reference(run: Run) -> FrozenModel:
    """The policy's starting point as a reference: with LoRA, the policy itself with its adapters switched off
    (no second model); otherwise a frozen copy of model.path beside it."""
    if run.cfg.lora.enabled:
        return FrozenModel(run.policy, run.token_loss, run.env.device, "adapters off",
                           lambda: lora.adapters_disabled(run.model))
    return beside_policy(run, run.cfg.model, run.model_config, "frozen copy")
