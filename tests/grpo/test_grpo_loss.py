"""llmtrain.losses.policy: the GRPO-family loss and its metrics equal the formulas written out per completion in
plain Python for each loss_type, beta 0 and > 0, num_iterations 1 (ratio 1, the policy gradient) and 2
(ratios against sampling-time log-probs, clipping on both sides); sums over two "ranks" or micro-batches
divided by the global counts give the whole batch's loss and gradients; group advantages and the reward
metrics equal numpy's with None rewards left out; TokenLoss.token_logps with a temperature gives
log_softmax(logits / temperature) and its gradients on the chunked path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import TINY
from llmtrain.config import ConfigError, load_config
from llmtrain.losses import policy
from llmtrain.losses.token import TokenLoss
from llmtrain.recipes.grpo import config as grpo
from helpers.heads import CONFIGS, HEADS, batch, loss_and_grads, tiny_head

ROWS, WIDTH, MAX_LEN = 6, 7, 9
EPS, EPS_HIGH = 0.2, 0.28


def inputs(seed: int = 0):
    """Per-token log-probs of 6 completions (lengths 7, 3, 5, 1, 0 (a masked truncated one), 6), sampling-time
    log-probs a random distance away (some ratios beyond either clip bound), reference log-probs, advantages
    of both signs and a zero."""
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 3, 5, 1, 0, 6]
    mask = torch.arange(WIDTH)[None] < torch.tensor(lengths)[:, None]
    logps = (-torch.rand(ROWS, WIDTH, generator=g, dtype=torch.float64) * 3).float()
    old = logps + (torch.rand(ROWS, WIDTH, generator=g) - 0.5) * 0.8
    ref = logps + (torch.rand(ROWS, WIDTH, generator=g) - 0.5) * 0.6
    adv = torch.tensor([1.3, -0.7, 0.0, -1.5, 0.9, 0.4])
    return logps, mask, old, ref, adv


def reference_loss(logps, mask, old, ref, adv, loss_type, beta, num_iterations, bias_correction_kl=True):
    """The loss and METRICS per completion in plain Python floats (TRL 1.16's _compute_loss, one batch)."""
    per_seq, tokens, low_fracs, high_fracs = [], 0, [], []
    kl_sum = low_sum = high_sum = region_sum = 0.0
    for i in range(ROWS):
        a, seq, seq_low, seq_high = float(adv[i]), [], 0, 0
        for t in range(WIDTH):
            if not mask[i, t]:
                continue
            lp = float(logps[i, t])
            o = lp if num_iterations == 1 else float(old[i, t])
            ratio = math.exp(lp - o)
            clipped = min(max(ratio, 1 - EPS), 1 + EPS_HIGH)
            loss = -min(ratio * a, clipped * a)
            d = float(ref[i, t]) - lp
            kl = (math.exp(d) - d - 1) * (ratio if bias_correction_kl else 1)
            if beta:
                loss += beta * kl
            seq.append(loss)
            kl_sum += kl
            low, high = ratio < 1 - EPS and a < 0, ratio > 1 + EPS_HIGH and a > 0
            low_sum, high_sum, region_sum = low_sum + low, high_sum + high, region_sum + (low or high)
            seq_low, seq_high = seq_low + low, seq_high + high
        per_seq.append(seq)
        if seq:
            low_fracs.append(seq_low / len(seq))
            high_fracs.append(seq_high / len(seq))
        tokens += len(seq)
    if loss_type == "grpo":
        value = sum(sum(s) / max(len(s), 1) for s in per_seq) / ROWS
    elif loss_type == "dr_grpo":
        value = sum(map(sum, per_seq)) / (ROWS * MAX_LEN)
    else:
        value = sum(map(sum, per_seq)) / tokens
    metrics = {"clip_ratio/low_mean": low_sum / tokens, "clip_ratio/high_mean": high_sum / tokens,
               "clip_ratio/region_mean": region_sum / tokens, "clip_ratio/low_min": min(low_fracs),
               "clip_ratio/high_max": max(high_fracs)}
    if beta:
        metrics["kl"] = kl_sum / tokens
    return value, metrics


def ours(rows: slice | list, logps, mask, old, ref, adv, loss_type, beta, num_iterations, bias_correction_kl=True):
    return policy.policy_sums(logps[rows], mask[rows], adv[rows], None if num_iterations == 1 else old[rows],
                              ref[rows] if beta else None, loss_type, EPS, EPS_HIGH, beta, bias_correction_kl)


CASES = pytest.mark.parametrize("loss_type,beta,num_iterations", [
    (lt, beta, it) for lt in policy.LOSS_TYPES for beta in (0.0, 0.04) for it in (1, 2)])


@CASES
@pytest.mark.parametrize("bias_correction_kl", [True, False])
def test_loss_and_metrics_equal_the_formulas(loss_type, beta, num_iterations, bias_correction_kl):
    logps, mask, old, ref, adv = inputs()
    want, want_metrics = reference_loss(logps, mask, old, ref, adv, loss_type, beta, num_iterations,
                                        bias_correction_kl)
    sums = ours(slice(None), logps, mask, old, ref, adv, loss_type, beta, num_iterations, bias_correction_kl)
    totals = policy.policy_counts(mask)
    assert totals.tolist() == [ROWS, 22]
    assert policy.objective(sums, totals, loss_type, MAX_LEN).item() == pytest.approx(want, abs=1e-6)
    got = policy.metrics(sums.metrics, sums.minima, int(totals[1]), beta)
    assert got.keys() == want_metrics.keys()
    for k, v in want_metrics.items():
        assert got[k] == pytest.approx(v, abs=1e-6), k
    if num_iterations == 2:  # the inputs reach past both bounds: the clip metrics are not trivially 0
        assert got["clip_ratio/low_mean"] > 0 and got["clip_ratio/high_max"] > 0


@pytest.mark.parametrize("loss_type", policy.LOSS_TYPES)
def test_one_iteration_is_the_policy_gradient(loss_type):
    """num_iterations=1: ratio 1, so d loss / d logp_it = -A_i x the loss_type's weight of token t."""
    logps, mask, _, _, adv = inputs()
    logps.requires_grad_()
    sums = policy.policy_sums(logps, mask, adv, None, None, loss_type, EPS, EPS_HIGH, 0.0)
    policy.objective(sums, policy.policy_counts(mask), loss_type, MAX_LEN).backward()
    n = mask.sum(1, keepdim=True).clamp(min=1).float()
    weight = {"grpo": 1 / (n * ROWS), "dr_grpo": torch.full_like(n, 1 / (ROWS * MAX_LEN))}.get(
        loss_type, torch.full_like(n, 1 / 22))
    assert torch.allclose(logps.grad, -adv[:, None] * weight * mask, atol=1e-7)


@CASES
def test_split_over_ranks_and_micro_batches_gives_the_whole_batch(loss_type, beta, num_iterations):
    """Rows 0-2 on one "rank" or micro-batch, 3-5 on another, and an uneven 0-3 / 4-5 split: the shares,
    each divided by the all-reduced counts, add up to the whole batch's loss, gradients and metrics."""
    logps, mask, old, ref, adv = inputs(seed=3)

    def run(parts):
        x = logps.clone().requires_grad_()
        counts = sum(policy.policy_counts(mask[p]) for p in parts)
        total, summed, minima = 0.0, 0, torch.full((2,), float("inf"))
        for p in parts:
            sums = policy.policy_sums(x[p], mask[p], adv[p], None if num_iterations == 1 else old[p],
                                      ref[p] if beta else None, loss_type, EPS, EPS_HIGH, beta)
            share = policy.objective(sums, counts, loss_type, MAX_LEN)
            share.backward()
            total, summed, minima = total + share.item(), summed + sums.metrics, torch.minimum(minima, sums.minima)
        return total, x.grad, policy.metrics(summed, minima, int(counts[1]), beta)

    whole = run([slice(0, ROWS)])
    for parts in ([slice(0, 3), slice(3, ROWS)], [slice(0, 4), slice(4, ROWS)]):
        got = run(parts)
        assert got[0] == pytest.approx(whole[0], abs=1e-6)
        assert torch.allclose(got[1], whole[1], atol=1e-7)
        assert got[2] == pytest.approx(whole[2], abs=1e-7)


def numpy_advantages(rewards: np.ndarray, g: int, scale: str) -> np.ndarray:
    groups = rewards.reshape(-1, g)
    mean = np.repeat(np.nanmean(groups, 1), g)
    std = np.repeat(np.nanstd(groups, 1, ddof=1), g) if scale != "batch" else np.full_like(rewards, np.nanstd(
        rewards, ddof=1))
    adv = rewards - mean
    return np.nan_to_num(adv / (std + 1e-4) if scale != "none" else adv)


@pytest.mark.parametrize("scale", policy.SCALE_REWARDS)
def test_group_advantages_and_reward_metrics_equal_numpy(scale):
    """3 groups of 4 from two functions (weights 1, 0.5): None rewards (NaN) left out; a completion no
    function scored gets advantage 0; the third group's equal rewards count in frac_reward_zero_std."""
    nan = math.nan
    per_func = torch.tensor([[1, 0], [0, 1], [1, 1], [0, nan],
                             [1, nan], [0, 0], [nan, nan], [1, 1],
                             [1, 0], [1, 0], [1, 0], [1, 0]], dtype=torch.float32)
    weights = [1.0, 0.5]
    adv = policy.group_advantages(per_func, weights, 4, scale)
    rewards = np.nansum(per_func.numpy() * np.array(weights), 1)
    rewards[6] = np.nan
    want = numpy_advantages(rewards, 4, scale)
    assert np.allclose(adv.advantages.numpy(), want, atol=1e-6) and adv.advantages[6] == 0
    m = policy.reward_metrics(per_func, ["a", "b"], adv)
    assert m["reward"] == pytest.approx(np.nanmean(rewards)) and m["reward_std"] == pytest.approx(
        np.nanstd(rewards, ddof=1))
    assert m["rewards/b/mean"] == pytest.approx(np.nanmean(per_func[:, 1].numpy()))
    assert m["rewards/b/std"] == pytest.approx(np.nanstd(per_func[:, 1].numpy(), ddof=1))
    assert m["frac_reward_zero_std"] == pytest.approx(0 if scale == "batch" else 4 / 12)
    # Groups spanning ranks: each rank's rows of the global advantages are its own completions' advantages.
    assert torch.equal(torch.cat([adv.advantages[:6], adv.advantages[6:]]), adv.advantages)


def test_grpo_section_checks_name_the_key():
    """Each key's range is load_config's (GRPOSection's ranged fields); grpo.check has the combinations."""
    ok = grpo.GRPOSection(reward_funcs=["llmtrain.rewards:exact_answer"])
    grpo.check(ok)
    for change, key in [(dict(num_generations=1), "grpo.num_generations"),
                        (dict(max_completion_length=0), "grpo.max_completion_length"),
                        (dict(temperature=0.0), "grpo.temperature"), (dict(top_p=0.0), "grpo.top_p"),
                        (dict(beta=-1.0), "grpo.beta"), (dict(num_iterations=0), "grpo.num_iterations")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(TINY, [f"{key}={v!r}" for v in change.values()], grpo.GRPOConfig)
    for change, key in [(dict(reward_funcs=[]), "grpo.reward_funcs"),
                        (dict(reward_weights=[1.0, 2.0]), "grpo.reward_weights")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            grpo.check(grpo.GRPOSection(**{**ok.__dict__, **change}))


@CONFIGS
@HEADS
def test_token_logps_with_temperature(config, head):
    """logits / temperature (after soft-capping, as TRL), on the full path and the chunked one (values and
    gradients through a nonlinear use of them); temperature 1 is the untouched path."""
    model, b = tiny_head(config, head), batch()
    chunked = TokenLoss("chunked", model, torch.device("cpu"), chunk_tokens=5)
    full = TokenLoss("full", model, torch.device("cpu"))
    weights = torch.randn(15, generator=torch.Generator().manual_seed(2))

    def weighted(logps):
        return torch.nn.functional.logsigmoid((weights * logps).sum() / 15) * 15

    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
    targets = b["labels"][:, 1:]
    keep = targets != -100
    manual = logits[:, :-1].div(0.7).log_softmax(-1).gather(2, targets.clamp(min=0)[..., None])[..., 0][keep]
    assert (full.token_logps(model, b, temperature=0.7).detach() - manual).abs().max() < 1e-5
    want, want_grads = loss_and_grads(model, lambda: weighted(full.token_logps(model, b, temperature=0.7)))
    got, grads = loss_and_grads(model, lambda: weighted(chunked.token_logps(model, b, temperature=0.7)))
    assert got.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-5)
    for name, g in want_grads.items():
        assert (grads[name] - g).abs().max().item() < 1e-5, name
    with torch.no_grad():
        assert (chunked.token_logps(model, b, temperature=0.7) - manual).abs().max() < 1e-5
        assert not torch.allclose(chunked.token_logps(model, b), manual, atol=1e-3)
