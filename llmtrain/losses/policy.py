"""Policy-gradient losses of the GRPO family (GRPO, BNPO, Dr. GRPO, DAPO) over sampled completions, with
TRL 1.16's GRPOTrainer formulas (trl/trainer/grpo_trainer.py, _generate_and_score_completions and
_compute_loss) and a global-batch normalisation.

Advantages (group_advantages): the rewards of every completion of the step, gathered from every rank in
global order (prompt-major: the G completions of a prompt are consecutive), r = Σ_f w_f r_f (nansum: a
reward function's None is left out), A = r - mean of the group, divided by std + 1e-4 (std with Bessel's
correction) of the group (scale_rewards=group), of the whole batch (batch), or not divided (none). A
completion that no function scored gets A = 0.

Per token t of completion i, with π the policy's log-probs (logits / temperature), π_old those at sampling
time (num_iterations = 1: the detached current ones, ratio 1 whose gradient is the policy gradient), π_ref
the reference's:
    ratio  ρ = exp(π - π_old)
    k3     exp(π_ref - π) - (π_ref - π) - 1, the k3 estimator of KL(π || π_ref), times ρ with
           use_bias_correction_kl (TRL 1.16's default, DeepSeek-V3.2: the unbiased reverse-KL gradient; ρ is
           differentiable, so this changes the gradient at ρ = 1 too)
    ℓ_it = -min(ρ A_i, clip(ρ, 1 - epsilon, 1 + epsilon_high) A_i) + beta k3 (the last term only with beta > 0)
m_it = 1 on trained completion tokens (up to and including the first EOS; none of a truncated completion
with mask_truncated_completions).

Drift guard (importance_weights, TRL 1.16's vllm_importance_sampling_correction): with π_eng the log-probs
the engine sampled with (logits / temperature after top-k / top-p, as sampled) and π_old the trainer's
recomputation at sampling time (num_iterations = 1: the detached current log-probs),
    d_it = π_old - π_eng;  w = exp(d_it) per token (importance_level token) or exp(Σ_t d_it m_it) per
    completion (sequence);  tis: min(w, C);  mis: w where w <= C, else 0;  none: not applied
with C = importance_cap; the surrogate term is multiplied by it: ℓ_it = -w min(ρ A, clip(ρ) A) + beta k3.
With top-k / top-p the engine's distribution is the filtered one, so d measures the filtering too (as
TRL's with vLLM's processed log-probs). Metrics (drift_metrics): sampling/logprob_diff/mean, /max (|d|
over trained tokens; TRL: sampling/sampling_logp_difference) and sampling/importance_ratio/min, /mean, /max
(of w as applied, the raw w with none; TRL: sampling/importance_sampling_ratio), over trained tokens or,
at the sequence level, over completions with a trained token (TRL: every completion).

Aggregation (loss_type), over the step's global batch of N completions of every rank and micro-batch:
  grpo     Σ_i (Σ_t ℓ m / max(Σ_t m, 1)) / N: each completion's token mean, averaged over completions
           (TRL: the same per micro-batch, then averaged over accumulation steps and ranks; equal when
           micro-batches hold as many completions)
  bnpo     Σ_it ℓ m / Σ_it m: a mean over the global batch's tokens (TRL: over each micro-batch's own
           tokens, then averaged over accumulation steps and ranks, which equals this on one micro-batch
           at one rank; with a split, TRL's depends on it and this does not, so here bnpo = dapo)
  dr_grpo  Σ_it ℓ m / (N · max_completion_length): a constant denominator (Liu et al. 2025)
  dapo     Σ_it ℓ m / Σ_it m, the token count of the whole generation batch over every rank (TRL's
           num_items_in_batch; Yu et al. 2025)
Each micro-batch gives sums (policy_sums), the caller all-reduces the counts (policy_counts) once per step,
and objective() divides, so 1 or 2 ranks and any accumulation split give the same loss and gradients.

Metrics, TRL's names, each a mean over the global batch's trained tokens (TRL: per micro-batch, the
same over one micro-batch): kl (beta > 0; the k3 term as in the loss, ratio-weighted or not),
clip_ratio/low_mean (ρ < 1 - epsilon with A < 0),
clip_ratio/high_mean (ρ > 1 + epsilon_high with A > 0), clip_ratio/region_mean (either); and over the
completions with a trained token, the smallest fraction of low-clipped tokens (clip_ratio/low_min) and the
largest of high-clipped ones (clip_ratio/high_max), as TRL's nanmin / nanmax. Reward metrics
(reward_metrics): reward, reward_std, rewards/<name>/mean, rewards/<name>/std, frac_reward_zero_std.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
EXTREMES = ("clip_ratio/low_min", "clip_ratio/high_max")  # over completions: reduced with MIN, not summed
STD_EPS = 1e-4  # TRL's: A = (r - mean) / (std + 1e-4)
CORRECTIONS = ("none", "tis", "mis")
IMPORTANCE_LEVELS = ("token", "sequence")


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """TRL's nanstd: the std of the non-NaN values with Bessel's correction (NaN below 2 values)."""
    keep = ~torch.isnan(x)
    count = keep.sum() if dim is None else keep.sum(dim)
    mean = torch.nanmean(x) if dim is None else torch.nanmean(x, dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2) if dim is None else torch.nanmean((x - mean) ** 2, dim)
    return torch.where(count > 1, (var * count / (count - 1)).sqrt(), torch.full_like(var, float("nan")))


def combine_rewards(per_func: torch.Tensor, weights: list[float] | None) -> torch.Tensor:
    """[completions, functions] rewards (NaN: not applicable) -> weighted nansum per completion, NaN where
    no function applied (TRL's unscorable completions)."""
    w = per_func.new_tensor(weights or [1.0] * per_func.shape[1])
    rewards = (per_func * w).nansum(1)
    return rewards.masked_fill(torch.isnan(per_func).all(1), float("nan"))


class Advantages(NamedTuple):
    advantages: torch.Tensor  # [completions]: the global batch's, in its order (slice your rank's rows)
    rewards: torch.Tensor     # [completions]: combined rewards, NaN where unscorable
    std_zero: torch.Tensor    # [completions] bool: the std that scaled (or would scale) it is ~0


def group_advantages(per_func: torch.Tensor, weights: list[float] | None, num_generations: int,
                     scale_rewards: str) -> Advantages:
    """per_func: [completions, functions] rewards of the whole step, every rank's, prompt-major (a group's
    G completions consecutive). TRL 1.16's sum_then_normalize aggregation."""
    rewards = combine_rewards(per_func.float(), weights)
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, 1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = _nanstd(rewards).expand_as(rewards)
    else:  # group; "none" computes it for frac_reward_zero_std only
        std = _nanstd(groups, 1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPS)
    return Advantages(advantages.nan_to_num(0.0), rewards, torch.isclose(std, torch.zeros_like(std)))


def reward_metrics(per_func: torch.Tensor, names: list[str], adv: Advantages) -> dict[str, float]:
    """TRL's reward metrics over the step's global batch: reward, reward_std, rewards/<name>/mean and /std
    (each over the completions the function scored), frac_reward_zero_std."""
    out = {"reward": torch.nanmean(adv.rewards).item(), "reward_std": _nanstd(adv.rewards).item()}
    for i, name in enumerate(names):
        out[f"rewards/{name}/mean"] = torch.nanmean(per_func[:, i].float()).item()
        out[f"rewards/{name}/std"] = _nanstd(per_func[:, i].float()).item()
    out["frac_reward_zero_std"] = adv.std_zero.float().mean().item()
    return out


def to_grid(flat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Flat per-token values in row-major order (TokenLoss.token_logps') -> [rows, positions], 0 elsewhere.
    masked_scatter keeps the gradient to the flat values."""
    return flat.new_zeros(mask.shape).masked_scatter(mask, flat)


def policy_counts(mask: torch.Tensor) -> torch.Tensor:
    """[completions, trained tokens] of one micro-batch (mask: [completions, positions]): the denominators,
    to all-reduce over the step. A completion with no trained token still counts (grpo, dr_grpo: as TRL)."""
    return torch.stack([torch.tensor(mask.shape[0], device=mask.device), mask.sum()])


class PolicySums(NamedTuple):
    loss: torch.Tensor     # the loss_type's numerator summed over the micro-batch (differentiable)
    metrics: torch.Tensor  # Σ over trained tokens of each METRICS entry (detached)
    minima: torch.Tensor   # [clip_ratio/low_min, -clip_ratio/high_max] over the micro-batch's completions
                           # (inf without any): combine with MIN (torch.minimum, all_reduce MIN)
    drift: torch.Tensor | None = None         # with engine log-probs: [Σ |d| m, Σ m, Σ w u, Σ u] (u: the ratio's
                                              # units, trained tokens or completions with one), summed
    drift_minima: torch.Tensor | None = None  # [-max |d|, min w, -max w] over them (inf without any): MIN


def importance_weights(trainer_logps: torch.Tensor, engine_logps: torch.Tensor, mask: torch.Tensor, correction: str,
                       cap: float, level: str) -> torch.Tensor:
    """The drift guard's weight w of each token, [completions, positions] (module docstring): exp(π_old - π_eng)
    per token or per completion (level), truncated at cap (tis), zeroed beyond it (mis) or raw (none). At the
    sequence level each token carries its completion's w."""
    m = mask.float()
    d = (trainer_logps.float() - engine_logps.float()) * m
    if level == "sequence":
        d = d.sum(1, keepdim=True).expand_as(m)
    elif level != "token":
        raise ValueError(f"grpo.importance_level: {level!r}; choose one of {', '.join(IMPORTANCE_LEVELS)}")
    w = torch.exp(d)
    if correction == "tis":
        return w.clamp(max=cap)
    if correction == "mis":
        return w.masked_fill(w > cap, 0.0)
    if correction != "none":
        raise ValueError(f"grpo.importance_correction: {correction!r}; choose one of {', '.join(CORRECTIONS)}")
    return w


def _drift(trainer_logps: torch.Tensor, engine_logps: torch.Tensor, w: torch.Tensor, mask: torch.Tensor,
           level: str) -> tuple[torch.Tensor, torch.Tensor]:
    """PolicySums.drift and .drift_minima of a micro-batch."""
    m = mask.bool()
    diff = (trainer_logps.float() - engine_logps.float()).abs()[m]
    ratios = w[m] if level == "token" else w[:, 0][m.any(1)]
    inf = torch.tensor(float("inf"), device=w.device)
    sums = torch.stack([diff.sum(), m.sum().to(diff.dtype), ratios.sum(), torch.tensor(float(len(ratios)),
                                                                                       device=w.device)])
    minima = torch.stack([-diff.max() if len(diff) else inf, ratios.min() if len(ratios) else inf,
                          -ratios.max() if len(ratios) else inf])
    return sums, minima


def policy_sums(logps: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, old_logps: torch.Tensor | None,
                ref_logps: torch.Tensor | None, loss_type: str, epsilon: float, epsilon_high: float | None,
                beta: float, bias_correction_kl: bool = True, engine_logps: torch.Tensor | None = None,
                correction: str = "none", cap: float = 2.0, level: str = "token") -> PolicySums:
    """logps, old_logps, ref_logps: [completions, positions] per-token log-probs (to_grid); mask: the trained
    tokens; advantages: [completions]. old_logps None: num_iterations = 1 (the detached current log-probs).
    ref_logps: needed when beta > 0. bias_correction_kl: grpo.use_bias_correction_kl. engine_logps: the
    engine's log-probs of the same tokens, for the drift guard (grpo.importance_correction, _cap, _level)."""
    if beta and ref_logps is None:
        raise ValueError("grpo.beta > 0 needs the reference's log-probs")
    m = mask.float()
    logps = logps.float()
    old = logps.detach() if old_logps is None else old_logps.float()
    adv = advantages.float()[:, None]
    high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(logps - old)
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - epsilon, 1 + high) * adv)
    if engine_logps is not None:
        w = importance_weights(old, engine_logps, m, correction, cap, level)
        if correction != "none":
            per_token = per_token * w
    kl = torch.zeros_like(m)
    if beta:
        delta = ref_logps.float() - logps
        kl = torch.exp(delta) - delta - 1
        if bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl
    if loss_type == "grpo":
        loss = ((per_token * m).sum(1) / m.sum(1).clamp(min=1)).sum()
    elif loss_type in ("bnpo", "dr_grpo", "dapo"):
        loss = (per_token * m).sum()
    else:
        raise ValueError(f"grpo.loss_type: {loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")
    with torch.no_grad():
        low = (ratio < 1 - epsilon) & (adv < 0)
        high_clipped = (ratio > 1 + high) & (adv > 0)
        metrics = torch.stack([(kl * m).sum(), (low * m).sum(), (high_clipped * m).sum(),
                               ((low | high_clipped) * m).sum()])
        scored = m.sum(1) > 0
        n = m.sum(1)[scored]
        inf = torch.tensor(float("inf"), device=m.device)
        low_frac, high_frac = (low * m).sum(1)[scored] / n, (high_clipped * m).sum(1)[scored] / n
        minima = torch.stack([low_frac.min() if len(n) else inf, -high_frac.max() if len(n) else inf])
        drift = _drift(old, engine_logps, w, m, level) if engine_logps is not None else (None, None)
    return PolicySums(loss, metrics, minima, *drift)


def objective(sums: PolicySums, totals: torch.Tensor, loss_type: str, max_completion_length: int) -> torch.Tensor:
    """This micro-batch's share of the step's loss; totals: policy_counts of every micro-batch and rank,
    summed. Dividing by global counts makes the sum of shares the global batch's loss, whatever the split."""
    completions, tokens = totals[0], totals[1]
    if loss_type == "grpo":
        return sums.loss / completions
    if loss_type == "dr_grpo":
        return sums.loss / (completions * max_completion_length)
    return sums.loss / tokens.clamp(min=1)  # bnpo, dapo


def metrics(summed: torch.Tensor, minima: torch.Tensor | None, tokens: float, beta: float) -> dict[str, float]:
    """METRICS as means over trained tokens, from PolicySums.metrics summed over micro-batches and ranks
    (kl only with beta > 0, as TRL logs it), and EXTREMES from PolicySums.minima combined with MIN (left
    out when no completion had a trained token)."""
    out = {name: value / max(tokens, 1) for name, value in zip(METRICS, summed.tolist())}
    if not beta:
        del out["kl"]
    if minima is None:  # not combined with MIN (the shared accumulation sums)
        return out
    low, neg_high = minima.tolist()
    if low != float("inf"):
        out.update({EXTREMES[0]: low, EXTREMES[1]: -neg_high})
    return out


DRIFT = ("sampling/logprob_diff/mean", "sampling/logprob_diff/max", "sampling/importance_ratio/min",
         "sampling/importance_ratio/mean", "sampling/importance_ratio/max")


def drift_metrics(summed: torch.Tensor, minima: torch.Tensor) -> dict[str, float]:
    """DRIFT from PolicySums.drift summed and .drift_minima combined with MIN over micro-batches and ranks
    (0 without a trained token, as TRL)."""
    diff, tokens, ratios, units = summed.tolist()
    neg_max_diff, low, neg_high = (0.0 if v == float("inf") else v for v in minima.tolist())
    return dict(zip(DRIFT, (diff / max(tokens, 1), 0.0 - neg_max_diff, low, ratios / max(units, 1), 0.0 - neg_high)))
