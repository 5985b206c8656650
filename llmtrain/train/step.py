"""The one micro-batch loop every recipe's step goes through: the step's denominators all-reduced before any
forward, then per micro-batch the recipe's objective under autocast, gradient sync on the last one only,
scaling so that the gradients are those of the global mean, backward; then clipping and the update (skipped
when non-finite). What is the recipe's own is its Objective (llmtrain.recipes: sft's TokenObjective, ...)."""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from typing import Callable, NamedTuple, Protocol

import torch
from torch import nn
from torch.distributed import ProcessGroup, ReduceOp

from llmtrain.data import SAMPLE_INDEX
from llmtrain.distributed import all_reduce
from llmtrain.losses.token import trained_tokens
from llmtrain.models import dropout, ulysses
from llmtrain.parallelize import Plan, autocast, grad_sync


class StepResult(NamedTuple):
    """What a step returns to the loop (llmtrain.train.loop): global loss, grad norm, trained tokens, whether
    the update was applied, and the objective's metrics for the logged record (equal on every rank)."""
    loss: float
    grad_norm: float
    n_tokens: int
    ok: bool
    extra: dict = {}


class Share(NamedTuple):
    loss: torch.Tensor     # this micro-batch's share of the step's global loss (differentiable)
    metrics: torch.Tensor  # 1-D sums for Objective.report (detached), summed over micro-batches and ranks
    minima: torch.Tensor | None = None  # 1-D (detached), the smallest over micro-batches and ranks
    maxima: torch.Tensor | None = None  # 1-D (detached), the largest over micro-batches and ranks


class Reduction(NamedTuple):
    """How each part of a Share combines over micro-batches (elementwise) and then over ranks (all_reduce)."""
    field: str
    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # two micro-batches' parts -> their combination
    op: ReduceOp


REDUCTIONS = (Reduction("metrics", torch.add, ReduceOp.SUM), Reduction("minima", torch.minimum, ReduceOp.MIN),
              Reduction("maxima", torch.maximum, ReduceOp.MAX))


def combined(shares: list[Share]) -> torch.Tensor:
    """Collective: the step's shares reduced (REDUCTIONS) over micro-batches and ranks, as Objective.report takes
    them: the summed metrics, then the minima, then the maxima (those an objective's shares carry)."""
    out = []
    for r in REDUCTIONS:
        parts = [getattr(share, r.field) for share in shares]
        if parts[0] is not None:
            total = parts[0]
            for part in parts[1:]:
                total = r.combine(total, part)
            out.append(all_reduce(total, r.op))
    return torch.cat(out)


class Objective(Protocol):
    """A recipe's training objective as sums over micro-batches divided by global totals, so that any world
    size and accumulation split gives the same loss and gradients."""

    def counts(self, batch: dict) -> torch.Tensor:
        """This micro-batch's denominators (1-D, may be empty); totals[1:] are their sums over the step's
        micro-batches and ranks (totals[0]: the global trained tokens)."""

    def share(self, model: nn.Module, batch: dict, totals: torch.Tensor) -> Share:
        """Forward (under the strategy's autocast) and this micro-batch's Share."""

    def report(self, metrics: torch.Tensor, totals: torch.Tensor) -> tuple[float, dict]:
        """From the step's combined shares (the summed Share.metrics, then its minima and maxima when it has them:
        combined()): (the step's loss, the recipe's metrics by name)."""


class Stepper(NamedTuple):
    """What the loop needs to take a step: the wrapped model and how it is trained."""
    model: nn.Module
    plan: Plan
    opt: torch.optim.Optimizer
    scaler: object
    max_grad_norm: float
    device: torch.device
    world_size: int
    sp_group: ProcessGroup | None = None  # parallel.sp_size > 1: the ranks that hold this rank's rows
    saved: Callable[[], AbstractContextManager] = nullcontext  # around each forward (train.activation_offloading)


def accumulate(s: Stepper, batches: list[dict], objective: Objective, key: tuple[int, int]) -> StepResult:
    """One optimizer step over the micro-batches of `batches`; key: (train.seed, step), with each micro-batch's
    SAMPLE_INDEX the key of its dropout masks (llmtrain.models.dropout)."""
    batches = [{k: v.to(s.device, non_blocking=True) for k, v in b.items()} for b in batches]
    local = torch.stack([torch.cat([trained_tokens(b["labels"]).reshape(1), objective.counts(b)]) for b in batches])
    totals = all_reduce(ulysses.once(s.sp_group, local.sum(0)))  # a sequence group's rows counted once
    shares = []
    for i, batch in enumerate(batches):
        with grad_sync(s.model, s.plan, enabled=i == len(batches) - 1), dropout.rows(*key, batch.get(SAMPLE_INDEX)):
            with autocast(s.plan, s.device), s.saved():
                part = objective.share(s.model, batch, totals)
            # Data-parallel wrappers average gradients over ranks: x world size makes them the global mean's (with
            # sequence groups too: each rank's backward reaches its own slice's part, the sum over ranks the step's).
            scaled = part.loss * s.world_size
            (s.scaler.scale(scaled) if s.scaler else scaled).backward()
        # keeps no graph alive; a sequence group's ranks hold the same sums of their whole rows (ulysses.whole)
        shares.append(part._replace(loss=None, metrics=ulysses.once(s.sp_group, part.metrics)))
    loss, extra = objective.report(combined(shares), totals)
    grad_norm, ok = update(s, loss)
    return StepResult(loss, grad_norm, int(totals[0]), ok, extra)


def update(s: Stepper, loss: float) -> tuple[float, bool]:
    """After the backward passes: clip, then step unless non-finite -> (grad norm, whether applied)."""
    if s.scaler:
        s.scaler.unscale_(s.opt)
    grad_norm = float(s.plan.strategy.clip_grad_norm(s.model, s.max_grad_norm))
    # fp16 overflows are the scaler's business (it skips that step); anything else non-finite is ours.
    ok = math.isfinite(loss) and (s.scaler is not None or math.isfinite(grad_norm))
    if ok:
        if s.scaler:
            s.scaler.step(s.opt)
            s.scaler.update()
        else:
            s.opt.step()
    s.opt.zero_grad(set_to_none=True)
    return grad_norm, ok

