"""Preference losses (DPO, IPO, SimPO) over batches laid out as llmtrain.data.preference.collate_pairs
makes them: B chosen rows, then the B rejected rows of the same pairs.

The loss is a mean over every pair of the global batch (and the optional SFT term a mean over every
chosen response token), whatever the split into micro-batches and ranks: each micro-batch gives sums
(PairSums), the caller all-reduces the counts (pair_counts) once per step, and objective() divides.

Formulas (Δ = policy minus reference summed log-probs of a response; |y| = its token count; σ = sigmoid):
  sigmoid  DPO, Rafailov et al. 2023: -(1-ε) log σ(β(Δc - Δr)) - ε log σ(-β(Δc - Δr)); ε = label_smoothing
           is conservative DPO (cDPO, Mitchell 2023); rewards β·Δ
  ipo      Azar et al. 2023, eq. 17, with TRL's per-token normalisation: (Δc/|c| - Δr/|r| - 1/(2β))²;
           rewards β·Δ (not normalised, as TRL logs them)
  simpo    Meng et al. 2024, reference-free: -(1-ε) log σ(β(ac - ar) - γ) - ε log σ(γ - β(ac - ar)) with
           a = summed log-prob / |y|; rewards β·a, and logps/* are these per-token averages (TRL's CPOTrainer)
The metrics are TRL's: rewards/chosen, rewards/rejected, rewards/accuracies (chosen reward > rejected),
rewards/margins, logps/chosen, logps/rejected, each a mean over pairs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from llmtrain.config import ConfigError
from llmtrain.data.formats import IGNORE
from llmtrain.losses.token import next_token_targets, token_logps, validation_sums  # noqa: F401  (token_logps: from full logits, here too)

REFERENCE_FREE = {"simpo"}


def check_settings(loss: str, label_smoothing: float, gamma: float, precompute_reference: bool) -> None:
    """Set-up checks across the dpo.* keys of these losses (each key's own range is load_config's: the recipe's
    DPOSection's ranged fields)."""
    if label_smoothing and loss == "ipo":
        raise ConfigError("dpo.label_smoothing applies to dpo.loss=sigmoid or simpo, not ipo")
    if gamma and loss != "simpo":
        raise ConfigError("dpo.gamma (the target reward margin) applies to dpo.loss=simpo only")
    if precompute_reference and loss in REFERENCE_FREE:
        raise ConfigError(f"dpo.precompute_reference: dpo.loss={loss} uses no reference model, so there is nothing "
                          "to precompute; set dpo.precompute_reference=false")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def sequence_logps(flat_logps: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat per-token log-probs (token_logps' order) -> (summed log-prob, trained-token count) per row.
    masked_scatter then a row sum, not index_add: same order of additions on every device."""
    keep = next_token_targets(labels) != IGNORE
    return flat_logps.new_zeros(keep.shape).masked_scatter(keep, flat_logps).sum(1), keep.sum(1)


def pair_counts(labels: torch.Tensor) -> torch.Tensor:
    """[pairs, chosen response tokens] of one micro-batch: the denominators, to all-reduce over the step."""
    keep = next_token_targets(labels) != IGNORE
    return torch.stack([torch.tensor(labels.shape[0] // 2, device=labels.device), keep[:labels.shape[0] // 2].sum()])


class PairSums(NamedTuple):
    loss: torch.Tensor     # Σ over pairs of the preference loss (differentiable)
    nll: torch.Tensor      # Σ over chosen response tokens of -log p: the SFT term's numerator (differentiable)
    metrics: torch.Tensor  # Σ over pairs of each METRICS entry (detached)


def preference_sums(logps: torch.Tensor, lengths: torch.Tensor, ref_logps: torch.Tensor | None, loss: str,
                    beta: float, label_smoothing: float = 0.0, gamma: float = 0.0) -> PairSums:
    """logps, lengths, ref_logps: per row (sequence_logps), chosen rows then rejected rows. ref_logps is
    the reference model's (None for reference-free losses)."""
    if (ref_logps is None) != (loss in REFERENCE_FREE):
        raise ValueError(f"dpo.loss={loss} {'takes no' if ref_logps is not None else 'needs'} reference log-probs")
    chosen, rejected = logps.float().chunk(2)
    n_chosen, n_rejected = lengths.chunk(2)
    if loss == "simpo":
        chosen, rejected = chosen / n_chosen, rejected / n_rejected
        reward_chosen, reward_rejected = beta * chosen, beta * rejected
        logits = reward_chosen - reward_rejected - gamma
        losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    else:
        ref_chosen, ref_rejected = ref_logps.float().chunk(2)
        delta_chosen, delta_rejected = chosen - ref_chosen, rejected - ref_rejected
        reward_chosen, reward_rejected = beta * delta_chosen, beta * delta_rejected
        if loss == "sigmoid":
            logits = reward_chosen - reward_rejected
            losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
        else:  # ipo
            losses = (delta_chosen / n_chosen - delta_rejected / n_rejected - 1 / (2 * beta)) ** 2
    margins = (reward_chosen - reward_rejected).detach()
    metrics = torch.stack([reward_chosen.detach().sum(), reward_rejected.detach().sum(), (margins > 0).sum(),
                           margins.sum(), chosen.detach().sum(), rejected.detach().sum()])
    return PairSums(losses.sum(), -logps.float().chunk(2)[0].sum(), metrics)


def objective(sums: PairSums, totals: torch.Tensor, sft_weight: float) -> torch.Tensor:
    """This micro-batch's share of the step's loss: Σ pair losses / global pairs + sft_weight · Σ chosen
    token NLL / global chosen tokens. totals is the all-reduced pair_counts of every micro-batch."""
    out = sums.loss / totals[0]
    return out + sft_weight * sums.nll / totals[1].clamp(min=1) if sft_weight else out


def metrics(summed: torch.Tensor, pairs: int) -> dict[str, float]:
    """METRICS as means over pairs, from PairSums.metrics summed over micro-batches and ranks."""
    return {name: value / max(pairs, 1) for name, value in zip(METRICS, summed.tolist())}


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, pair_logps, device: torch.device, loss: str, beta: float,
             label_smoothing: float, gamma: float, sft_weight: float) -> dict[str, float]:
    """The training objective and METRICS over every rank's validation pairs, as global means whatever the
    world size: {"val_loss", "val_rewards/chosen", ...}. pair_logps(batch) -> (policy log-probs, lengths,
    reference log-probs or None) per row. Collective: every rank passes as many batches (eval_batches)."""
    def sums(batch: dict) -> torch.Tensor | None:
        logps, lengths, ref = pair_logps(batch)  # every rank runs the forwards, even on a filler batch
        if (batch["labels"] == IGNORE).all():  # eval_batches' filler for a rank out of pairs: no pair in it
            return None
        s = preference_sums(logps, lengths, ref, loss, beta, label_smoothing, gamma)
        return torch.cat([torch.stack([s.loss, s.nll]), pair_counts(batch["labels"]), s.metrics])
    totals = validation_sums(model, batches, device, 4 + len(METRICS), sums)  # loss, nll, pairs, chosen tokens
    val_loss = objective(PairSums(totals[0], totals[1], totals[4:]), totals[2:4], sft_weight)
    return {"val_loss": val_loss.item(), **{f"val_{k}": v for k, v in metrics(totals[4:], int(totals[2])).items()}}
