"""KTO's loss (Ethayarajh et al. 2024, TRL 1.16's KTOTrainer) over unpaired rows, each a completion labelled
desirable or undesirable, as llmtrain.data.unpaired collates them.

Per row, with Δ = policy minus reference summed log-prob of its completion, σ = sigmoid, z0 the KL point:
  kto                desirable 1 - σ(β(Δ - z0)), undesirable 1 - σ(β(z0 - Δ))  (the paper's eq. 7)
  apo_zero_unpaired  desirable 1 - σ(βΔ), undesirable σ(βΔ)  (APO-zero, D'Oosterlinck et al. 2024; no KL point)
times desirable_weight or undesirable_weight; the loss is their mean over every row of the step's global batch.

The KL point z0 = max(0, mean over the step's KL rows of (policy minus reference summed log-prob)): each row's
prompt with another row's completion (the KL rows, llmtrain.data.unpaired), no gradient. TRL takes that mean over a
micro-batch (gathered over ranks); here it is over every row of the step, summed per micro-batch before any loss
(kl_sums) and all-reduced with the step's other denominators, so that any world size and accumulation split gives
the same z0, loss and gradients, and a step of one micro-batch on one rank gives TRL's.

The metrics are TRL's: rewards/chosen and logps/chosen (means over the desirable rows of βΔ and of the policy's
summed log-prob), rewards/rejected and logps/rejected (over the undesirable rows), rewards/margins (the two reward
means' difference), and kl (z0). A side the step has no row of logs none of its metrics (nor the margin), as
TRL."""

from __future__ import annotations

from typing import NamedTuple

import torch

from llmtrain.config import ConfigError

LOSS_TYPES = ("kto", "apo_zero_unpaired")
SIDE_METRICS = {"chosen": ("rewards/chosen", "logps/chosen"), "rejected": ("rewards/rejected", "logps/rejected")}


def uses_kl(loss_type: str) -> bool:
    """Whether the loss reads the KL point (TRL's calculate_KL): APO-zero does not, and needs no KL rows."""
    return loss_type == "kto"


def check_sides(desirable: int, undesirable: int, where: str) -> None:
    """KTO weighs desirable against undesirable completions: data with one side only teaches nothing the loss is
    for (and its weights mean nothing). One line saying what to do."""
    if desirable and undesirable:
        return
    have, lack = ("desirable (label true)", "undesirable (label false)")[::1 if desirable else -1]
    raise ConfigError(f"{where}: every one of its {desirable + undesirable} rows is {have}; KTO needs {lack} rows too: "
                      "add some (e.g. the rejected responses of preference pairs, label false), or train on "
                      "desirable rows alone with recipes/finetune.py")


def kl_sums(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """A micro-batch's KL rows -> Σ (policy - reference) summed log-prob: the KL point's numerator (its
    denominator is the step's row count), detached."""
    return (kl_logps.detach().double() - ref_kl_logps.double()).sum()


def kl_point(summed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """z0 = max(0, the step's mean over its KL rows), from kl_sums summed over micro-batches and ranks."""
    return (summed / rows).clamp(min=0).float()


class RowSums(NamedTuple):
    loss: torch.Tensor     # Σ over rows of the weighted loss (differentiable)
    metrics: torch.Tensor  # Σ over desirable rows of βΔ and of log-prob, then over undesirable rows (detached)


def kto_sums(logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0, loss_type: str = "kto") -> RowSums:
    """logps, ref_logps: the policy's and reference's summed log-prob of each row's completion; desirable: [rows]
    bool (the label); kl: z0 (kl_point; ignored by apo_zero_unpaired)."""
    logps = logps.float()
    delta = logps - ref_logps.float()
    if loss_type == "kto":
        good, bad = 1 - torch.sigmoid(beta * (delta - kl)), 1 - torch.sigmoid(beta * (kl - delta))
    else:  # apo_zero_unpaired
        good, bad = 1 - torch.sigmoid(beta * delta), torch.sigmoid(beta * delta)
    losses = torch.where(desirable, desirable_weight * good, undesirable_weight * bad)
    rewards, logps = (beta * delta).detach(), logps.detach()
    metrics = torch.stack([rewards.where(desirable, 0).sum(), logps.where(desirable, 0).sum(),
                           rewards.where(~desirable, 0).sum(), logps.where(~desirable, 0).sum()])
    return RowSums(losses.sum(), metrics)


def side_counts(desirable: torch.Tensor) -> torch.Tensor:
    """[desirable rows, undesirable rows] of a micro-batch: the denominators, to all-reduce over the step."""
    n = desirable.sum()
    return torch.stack([n, desirable.numel() - n])


def objective(sums: RowSums, rows: torch.Tensor) -> torch.Tensor:
    """This micro-batch's share of the step's loss: Σ row losses / the step's global rows."""
    return sums.loss / rows


def metrics(summed: torch.Tensor, desirable: int, undesirable: int, kl: float) -> dict[str, float]:
    """TRL's names (the module docstring) from RowSums.metrics summed over micro-batches and ranks."""
    out = {"kl": kl}
    values = summed.tolist()
    for (side, names), n, at in zip(SIDE_METRICS.items(), (desirable, undesirable), (0, 2)):
        if n:
            out |= {names[0]: values[at] / n, names[1]: values[at + 1] / n}
    if desirable and undesirable:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out
