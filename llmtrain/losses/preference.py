"""Preference losses (DPO, IPO, SimPO, ORPO, CPO) over batches laid out as llmtrain.data.preference.collate_pairs
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
  orpo     Hong et al. 2024 eq. 6-7 as TRL's ORPOTrainer, reference-free: -β log σ(log odds(ac) - log odds(ar))
           with odds(a) = e^a / (1 - e^a) on the per-token averages a (β is the paper's λ), plus the mean NLL
           of the chosen rows' prompt and response tokens (weight 1; scored_labels); rewards β·a
  cpo      Xu et al. 2024 as TRL's CPOTrainer, reference-free, on z = pc - pr with p summed (cpo_loss_type
           sigmoid, hinge) or averaged per token (ipo, simpo): sigmoid -(1-ε) log σ(βz) - ε log σ(-βz); hinge
           max(0, 1 - βz); ipo (z - 1/(2β))²; simpo sigmoid's with βz - γ; plus cpo_alpha × the chosen tokens'
           mean NLL; rewards β·p
The metrics are TRL's: rewards/chosen, rewards/rejected, rewards/accuracies (chosen reward > rejected),
rewards/margins, logps/chosen, logps/rejected, each a mean over pairs; orpo and cpo add nll_loss (the chosen
tokens' mean NLL), orpo log_odds_ratio (mean log σ(log odds ratio)) and log_odds_chosen (its argument's mean).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from llmtrain.config import ConfigError
from llmtrain.data.formats import IGNORE
from llmtrain.losses.token import next_token_targets, token_logps, validation_sums  # noqa: F401  (token_logps: from full logits, here too)

REFERENCE_FREE = {"simpo", "orpo", "cpo"}
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
CPO_ALPHA = 1.0  # TRL's CPOConfig default


def kind(loss: str, cpo_loss_type: str) -> str:
    """The formula a reference-free loss applies to its log-probs: CPO's loss type, else the loss itself."""
    return cpo_loss_type if loss == "cpo" else loss


def averaged(loss: str, cpo_loss_type: str) -> bool:
    """Whether the loss reads per-token average log-probs (SimPO, ORPO, CPO's ipo / simpo) rather than sums."""
    return loss in REFERENCE_FREE and kind(loss, cpo_loss_type) in ("simpo", "orpo", "ipo")


def check_settings(loss: str, label_smoothing: float, gamma: float, precompute_reference: bool,
                   cpo_loss_type: str = "sigmoid", cpo_alpha: float = CPO_ALPHA, sft_weight: float = 0.0) -> None:
    """Set-up checks across the dpo.* keys of these losses (each key's own range is load_config's: the recipe's
    DPOSection's ranged fields)."""
    formula = kind(loss, cpo_loss_type)
    if label_smoothing and formula not in ("sigmoid", "simpo"):
        raise ConfigError(f"dpo.label_smoothing applies to dpo.loss=sigmoid or simpo (or cpo with "
                          f"dpo.cpo_loss_type=sigmoid or simpo), not {loss}"
                          + (f" with dpo.cpo_loss_type={cpo_loss_type}" if loss == "cpo" else ""))
    if gamma and formula != "simpo":
        raise ConfigError("dpo.gamma (the target reward margin) applies to dpo.loss=simpo (or cpo with "
                          "dpo.cpo_loss_type=simpo) only")
    if loss != "cpo" and (cpo_loss_type != "sigmoid" or cpo_alpha != CPO_ALPHA):
        raise ConfigError(f"dpo.cpo_loss_type and dpo.cpo_alpha apply to dpo.loss=cpo only, not {loss}")
    if sft_weight and loss in ("orpo", "cpo"):
        raise ConfigError(f"dpo.sft_weight: dpo.loss={loss} has its own chosen-NLL term ("
                          + ("weight 1" if loss == "orpo" else "dpo.cpo_alpha") + "); set dpo.sft_weight=0")
    if precompute_reference and loss in REFERENCE_FREE:
        raise ConfigError(f"dpo.precompute_reference: dpo.loss={loss} uses no reference model, so there is nothing "
                          "to precompute; set dpo.precompute_reference=false")


def nll_weight(loss: str, sft_weight: float, cpo_alpha: float) -> float:
    """The weight of the chosen tokens' mean NLL in the objective: ORPO's is 1, CPO's cpo_alpha, the others'
    dpo.sft_weight."""
    return {"orpo": 1.0, "cpo": cpo_alpha}.get(loss, sft_weight)


METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
# TRL's further names: ORPOTrainer and CPOTrainer log the chosen NLL, ORPOTrainer its odds ratio too.
EXTRA_METRICS = {"orpo": ("nll_loss", "log_odds_ratio", "log_odds_chosen"), "cpo": ("nll_loss",)}


def metric_names(loss: str) -> tuple[str, ...]:
    return METRICS + EXTRA_METRICS.get(loss, ())


def sequence_logps(flat_logps: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat per-token log-probs (token_logps' order) -> (summed log-prob, trained-token count) per row.
    masked_scatter then a row sum, not index_add: same order of additions on every device."""
    keep = next_token_targets(labels) != IGNORE
    return flat_logps.new_zeros(keep.shape).masked_scatter(keep, flat_logps).sum(1), keep.sum(1)


def scored_labels(loss: str, batch: dict) -> torch.Tensor:
    """The labels a forward scores: the batch's, and for ORPO the chosen rows' prompt tokens too (TRL 1.16's
    ORPOTrainer takes its NLL over every attended token of the chosen rows, prompt included)."""
    labels = batch["labels"]
    if loss != "orpo":
        return labels
    chosen = labels[:labels.shape[0] // 2]
    at = torch.arange(labels.shape[1], device=labels.device)
    end = torch.where(chosen != IGNORE, at, -1).amax(1, keepdim=True)  # the response's last token: no padding
    return torch.cat([torch.where(at <= end, batch["input_ids"][:chosen.shape[0]], IGNORE), labels[chosen.shape[0]:]])


def response_logps(flat_logps: torch.Tensor, scored: torch.Tensor,
                   labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat log-probs of the scored tokens (scored_labels') -> (summed response log-prob per row, response tokens
    per row, Σ -log p over the chosen rows' scored tokens: the NLL term's numerator). With scored = labels the
    first two are sequence_logps', the third minus the sum of the chosen rows' first."""
    grid = flat_logps.new_zeros(scored.shape).masked_scatter(next_token_targets(scored) != IGNORE, flat_logps)
    response = next_token_targets(labels) != IGNORE
    return grid.where(response, 0).sum(1), response.sum(1), -grid[:labels.shape[0] // 2].sum(1).float().sum()


def pair_counts(labels: torch.Tensor) -> torch.Tensor:
    """[pairs, chosen response tokens] of one micro-batch: the denominators, to all-reduce over the step."""
    keep = next_token_targets(labels) != IGNORE
    return torch.stack([torch.tensor(labels.shape[0] // 2, device=labels.device), keep[:labels.shape[0] // 2].sum()])


class PairSums(NamedTuple):
    loss: torch.Tensor     # Σ over pairs of the preference loss (differentiable)
    nll: torch.Tensor      # Σ over chosen response tokens of -log p: the SFT term's numerator (differentiable)
    metrics: torch.Tensor  # Σ over pairs of each METRICS entry (detached)


def preference_sums(logps: torch.Tensor, lengths: torch.Tensor, ref_logps: torch.Tensor | None, loss: str,
                    beta: float, label_smoothing: float = 0.0, gamma: float = 0.0,
                    cpo_loss_type: str = "sigmoid", nll: torch.Tensor | None = None) -> PairSums:
    """logps, lengths, ref_logps: per row (sequence_logps), chosen rows then rejected rows. ref_logps is
    the reference model's (None for reference-free losses). nll: response_logps' (ORPO's covers the prompts),
    by default the chosen responses' summed -log p."""
    if (ref_logps is None) != (loss in REFERENCE_FREE):
        raise ValueError(f"dpo.loss={loss} {'takes no' if ref_logps is not None else 'needs'} reference log-probs")
    chosen, rejected = logps.float().chunk(2)
    n_chosen, n_rejected = lengths.chunk(2)
    nll = -chosen.sum() if nll is None else nll
    extra = []
    if loss in REFERENCE_FREE:
        if averaged(loss, cpo_loss_type):
            chosen, rejected = chosen / n_chosen, rejected / n_rejected
        reward_chosen, reward_rejected = beta * chosen, beta * rejected
        if loss == "orpo":
            log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
            ratio = F.logsigmoid(log_odds)
            losses = -beta * ratio
            extra = [ratio.detach().sum(), log_odds.detach().sum()]
        else:
            losses = reference_free_losses(kind(loss, cpo_loss_type), chosen - rejected, beta, label_smoothing, gamma)
        if loss in EXTRA_METRICS:
            extra.insert(0, nll.detach())  # nll_loss: metrics() divides it by the chosen tokens
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
                           margins.sum(), chosen.detach().sum(), rejected.detach().sum(), *extra])
    return PairSums(losses.sum(), nll, metrics)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0 without cancellation: log1p(-e^x) below -ln 2, log(-expm1(x)) above (as TRL)."""
    return torch.where(x < -math.log(2), torch.log1p(-x.exp()), torch.log(-torch.expm1(x)))


def reference_free_losses(formula: str, z: torch.Tensor, beta: float, label_smoothing: float,
                          gamma: float) -> torch.Tensor:
    """Per pair: SimPO's and CPO's losses of z = chosen - rejected log-probs (summed or averaged as the
    formula wants), as TRL's CPOTrainer.cpo_loss computes them."""
    if formula == "hinge":
        return torch.relu(1 - beta * z)
    if formula == "ipo":
        return (z - 1 / (2 * beta)) ** 2
    logits = beta * z - gamma if formula == "simpo" else beta * z  # sigmoid
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def objective(sums: PairSums, totals: torch.Tensor, sft_weight: float) -> torch.Tensor:
    """This micro-batch's share of the step's loss: Σ pair losses / global pairs + sft_weight · Σ chosen
    token NLL / global chosen tokens. totals is the all-reduced pair_counts of every micro-batch."""
    out = sums.loss / totals[0]
    return out + sft_weight * sums.nll / totals[1].clamp(min=1) if sft_weight else out


def metrics(summed: torch.Tensor, pairs: int, loss: str = "sigmoid", chosen_tokens: int = 1) -> dict[str, float]:
    """metric_names(loss) as means over pairs (nll_loss over chosen tokens), from PairSums.metrics summed over
    micro-batches and ranks."""
    return {name: value / max(chosen_tokens if name == "nll_loss" else pairs, 1)
            for name, value in zip(metric_names(loss), summed.tolist())}


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, pair_logps, device: torch.device, loss: str, beta: float,
             label_smoothing: float, gamma: float, sft_weight: float,
             cpo_loss_type: str = "sigmoid", sp_group=None) -> dict[str, float]:
    """The training objective and metric_names(loss) over every rank's validation pairs, as global means whatever
    the world size: {"val_loss", "val_rewards/chosen", ...}. pair_logps(batch) -> (policy log-probs, lengths,
    NLL numerator, reference log-probs or None): response_logps' and the reference's; sft_weight: nll_weight's;
    sp_group: validation_sums'. Collective: every rank passes as many batches (eval_batches)."""
    def sums(batch: dict) -> torch.Tensor | None:
        logps, lengths, nll, ref = pair_logps(batch)  # every rank runs the forwards, even on a filler batch
        if (batch["labels"] == IGNORE).all():  # eval_batches' filler for a rank out of pairs: no pair in it
            return None
        s = preference_sums(logps, lengths, ref, loss, beta, label_smoothing, gamma, cpo_loss_type, nll)
        return torch.cat([torch.stack([s.loss, s.nll]), pair_counts(scored_labels(loss, batch)), s.metrics])
    totals = validation_sums(model, batches, device, 4 + len(metric_names(loss)), sums,  # loss, nll, pairs, tokens
                             sp_group)
    val_loss = objective(PairSums(totals[0], totals[1], totals[4:]), totals[2:4], sft_weight)
    means = metrics(totals[4:], int(totals[2]), loss, int(totals[3]))
    return {"val_loss": val_loss.item(), **{f"val_{k}": v for k, v in means.items()}}
