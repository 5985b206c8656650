"""The frozen-model component: a model beside the policy that takes no gradient and runs its own forward under
the policy's parallel strategy. DPO's and GRPO's reference (`reference`), distillation's teacher (`beside_policy`,
or `standalone` for the teacher's precompute, which has no policy) and GRPO's reward models (`reward_model`) are
built here and used through one call: `FrozenModel.forward(fn)` runs fn(model, token_loss) under no_grad in the
model's own compute dtype."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import PreTrainedTokenizerBase

from llmtrain.config import ModelConfig, ParallelConfig
from llmtrain.distributed import DistEnv
from llmtrain.losses.token import TokenLoss
from llmtrain.models import hf, lora
from llmtrain.models.build import BuiltModel, build_model
from llmtrain.train.build import Run


@dataclass
class FrozenModel:
    """built: the model (its parameters, plan and size); token_loss: its own TokenLoss (freed with it; None for a
    reward model, which has no output layer over the vocabulary); kind: what it is, for the log ("frozen copy",
    "adapters off", "teacher", "reward model"); off: a context around its forward (LoRA's adapters switched off,
    when the frozen model is the policy itself)."""
    built: BuiltModel
    token_loss: TokenLoss | None
    device: torch.device
    kind: str
    off: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    @property
    def model(self) -> torch.nn.Module:
        return self.built.model

    def describe(self) -> str:
        """For the log: its size, how it is held and its compute dtype."""
        b = self.built
        return (f"{b.n_params / 1e6:.2f}M parameters, frozen, {b.plan.strategy.name}, computes in "
                f"{str(b.plan.dtype).removeprefix('torch.')}")

    def autocast(self) -> contextlib.AbstractContextManager:
        """Its own compute dtype, on or off explicitly: it may run inside the policy's forward, whose autocast
        it must not inherit."""
        plan = self.built.plan
        return torch.autocast(self.device.type, dtype=plan.dtype, enabled=plan.autocast)

    def forward(self, fn: Callable[[torch.nn.Module, TokenLoss | None], object]) -> object:
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


def reward_model(run: Run, path: str) -> tuple[FrozenModel, PreTrainedTokenizerBase]:
    """The sequence classifier at `path` (a reward model: rewards.check_model's), frozen next to the policy and
    sharded on its mesh, computing in the policy's dtype, with its own tokenizer; its config's pad_token_id is the
    tokenizer's (as TRL sets it: the score is read at the last token that is not that pad)."""
    cfg, env = run.cfg, run.env
    tokenizer = hf.load_tokenizer(path, cfg.model.trust_remote_code)
    source = ModelConfig(path=path, trust_remote_code=cfg.model.trust_remote_code,
                         attn_implementation=cfg.model.attn_implementation)
    config = hf.load_model_config(source, tokenizer)
    config.pad_token_id = tokenizer.pad_token_id
    built = build_model(source, config, cfg.parallel, env, cfg.train.seed, frozen_next_to=run.policy)
    return FrozenModel(built, None, env.device, "reward model"), tokenizer


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
