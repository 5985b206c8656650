"""AdamW with decay/no-decay groups, and the learning rate as a pure function of the step."""

from __future__ import annotations

import math

import torch
from torch import nn

from llmtrain.config import TrainConfig
from llmtrain.models.names import clean_name


def peak_lr(section: TrainConfig, dp_size: int) -> float:
    """Linear scaling rule, when asked for: the global batch grows with the data-parallel size."""
    return section.lr * (dp_size if section.scale_lr else 1)


def no_decay_names(model: nn.Module) -> set[str]:
    """Norm weights and biases (1-D), by name, read before wrapping: FSDP flattens parameters."""
    return {name for name, p in model.named_parameters() if p.ndim < 2}


def build_optimizer(model: nn.Module, section: TrainConfig, lr: float, no_decay: set[str]) -> torch.optim.AdamW:
    params = {clean_name(name): p for name, p in model.named_parameters()}
    if not no_decay <= params.keys():  # a wrapper renamed parameters: fail loudly rather than decay norms
        raise RuntimeError(f"parameters not found after wrapping: {sorted(no_decay - params.keys())[:3]}")
    trained = {name: p for name, p in params.items() if p.requires_grad}
    groups = [{"params": [p for n, p in trained.items() if n not in no_decay], "weight_decay": section.weight_decay},
              {"params": [p for n, p in trained.items() if n in no_decay], "weight_decay": 0.0}]
    # Fused: one kernel for all parameters, on GPU and CPU alike (the default per-parameter loop costs
    # ~3% of a CPU demo step with FSDP2, where every op on a DTensor is dispatched separately).
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(section.betas), fused=True)


def lr_at(step: int, section: TrainConfig, peak: float) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up, then the chosen decay
    down to min_lr_ratio x peak at max_steps."""
    if step < section.warmup_steps:
        return peak * (step + 1) / section.warmup_steps
    if section.lr_schedule == "constant":
        return peak
    progress = min(1.0, (step - section.warmup_steps) / max(1, section.max_steps - section.warmup_steps))
    floor = peak * section.min_lr_ratio
    if section.lr_schedule == "linear":
        return floor + (peak - floor) * (1 - progress)
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_note(section: TrainConfig) -> str | None:
    """A warm-up longer than the run ends it before the lr reaches its peak: said at start rather than refused,
    since a short trial of a long config (train.max_steps=4) is a legitimate thing to run."""
    if section.warmup_steps <= section.max_steps:
        return None
    return (f"warning: train.warmup_steps={section.warmup_steps} is longer than the run (train.max_steps="
            f"{section.max_steps}): the lr rises to {100 * section.max_steps / section.warmup_steps:.3g}% of its peak "
            f"and never reaches it; set train.warmup_steps<={section.max_steps} for the full schedule")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
