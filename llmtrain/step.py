"""One optimizer step: forward/backward over the micro-batches with the token-weighted loss,
gradient sync only on the last one, clipping, and the update (skipped when non-finite)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from llmtrain.distributed import all_reduce
from llmtrain.losses.token import TokenLoss, trained_tokens
from llmtrain.parallelize import Plan, autocast, grad_sync


class StepResult(NamedTuple):
    """What a recipe's step returns to the loop (llmtrain.train.loop): global loss, grad norm, trained tokens,
    whether the update was applied, and the recipe's own metrics for the logged record (equal on every rank)."""
    loss: float
    grad_norm: float
    n_tokens: int
    ok: bool
    extra: dict = {}


def train_step(model: nn.Module, plan: Plan, batches: list[dict], opt: torch.optim.Optimizer, scaler,
               max_grad_norm: float, device: torch.device, world_size: int,
               token_loss: TokenLoss) -> StepResult:
    """One optimizer step over grad_accum_steps micro-batches of the token-weighted cross-entropy."""
    local = torch.stack([trained_tokens(b["labels"]) for b in batches]).sum()
    n_tokens = int(all_reduce(local.to(device)).item())
    # Data-parallel wrappers average gradients over ranks; scaling by world/n makes the result the
    # gradient of (sum of all token losses) / (global trained tokens).
    scale = world_size / max(n_tokens, 1)
    loss_sum = torch.zeros((), device=device)
    for i, batch in enumerate(batches):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with grad_sync(model, plan, enabled=i == len(batches) - 1):
            with autocast(plan, device):
                loss = token_loss.loss_sum(model, batch)
            scaled = loss * scale
            (scaler.scale(scaled) if scaler else scaled).backward()
        loss_sum += loss.detach()
    loss = all_reduce(loss_sum).item() / max(n_tokens, 1)
    grad_norm, ok = update(model, plan, opt, scaler, max_grad_norm, loss)
    return StepResult(loss, grad_norm, n_tokens, ok)


def update(model: nn.Module, plan: Plan, opt: torch.optim.Optimizer, scaler, max_grad_norm: float,
           loss: float) -> tuple[float, bool]:
    """After the backward passes: clip, then step unless non-finite -> (grad norm, whether applied)."""
    if scaler:
        scaler.unscale_(opt)
    grad_norm = float(plan.strategy.clip_grad_norm(model, max_grad_norm))
    # fp16 overflows are the scaler's business (it skips that step); anything else non-finite is ours.
    ok = math.isfinite(loss) and (scaler is not None or math.isfinite(grad_norm))
    if ok:
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    opt.zero_grad(set_to_none=True)
    return grad_norm, ok
