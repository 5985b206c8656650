"""The drift guard (llmtrain.losses.policy): importance weights equal TRL 1.16's vllm_importance_sampling
formulas written out in plain Python (token and sequence level, tis / mis / none); an engine whose log-probs
are perturbed changes the loss and its gradients by exactly those weights (none: not at all); the metrics
(sampling/logprob_diff/*, sampling/importance_ratio/*) equal their formulas and are the same whatever the
micro-batch split; bad grpo.importance_* values are refused naming the key."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import TINY
from llmtrain.config import ConfigError, load_config
from llmtrain.losses import policy
from llmtrain.recipes.grpo import GRPOConfig

ROWS, WIDTH, MAX_LEN, CAP = 5, 6, 8, 2.0
EPS, EPS_HIGH = 0.2, 0.28
LENGTHS = [6, 3, 0, 4, 1]  # the third: a masked truncated completion


def inputs(seed: int = 0):
    """Trainer log-probs, a trainer at sampling time (num_iterations 2) a little away, an engine whose
    log-probs are perturbed by up to +-1.2 nats (ratios past the cap both ways), advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(WIDTH)[None] < torch.tensor(LENGTHS)[:, None]
    logps = -torch.rand(ROWS, WIDTH, generator=g) * 3
    old = logps + (torch.rand(ROWS, WIDTH, generator=g) - 0.5) * 0.4
    engine = old + (torch.rand(ROWS, WIDTH, generator=g) - 0.5) * 2.4
    adv = torch.tensor([1.1, -0.6, 0.7, -1.4, 0.5])
    return logps, mask, old, engine, adv


def formula_weights(trainer, engine, mask, correction, level) -> list[list[float]]:
    """TRL's: d = (old - engine) * mask; ratio exp(d) per token or exp(Σ d) per sequence; *_truncate clamps at
    the cap, *_mask zeroes what exceeds it."""
    out = []
    for i in range(ROWS):
        d = [float(trainer[i, t] - engine[i, t]) if mask[i, t] else 0.0 for t in range(WIDTH)]
        ratios = [math.exp(x) for x in d] if level == "token" else [math.exp(sum(d))] * WIDTH
        if correction == "tis":
            ratios = [min(r, CAP) for r in ratios]
        elif correction == "mis":
            ratios = [r if r <= CAP else 0.0 for r in ratios]
        out.append(ratios)
    return out


@pytest.mark.parametrize("level", policy.IMPORTANCE_LEVELS)
@pytest.mark.parametrize("correction", policy.CORRECTIONS)
def test_weights_equal_the_formulas(correction, level):
    _, mask, old, engine, _ = inputs()
    got = policy.importance_weights(old, engine, mask, correction, CAP, level)
    want = torch.tensor(formula_weights(old, engine, mask, correction, level))
    assert torch.allclose(got[mask], want[mask], rtol=1e-6, atol=0)
    if correction == "tis" and level == "token":  # the inputs reach past the cap: the weights are not trivial
        assert got[mask].max() == CAP and got[mask].min() < 1
    if correction == "mis" and level == "token":
        assert (got[mask] == 0).any() and (got[mask] > 1).any()


@pytest.mark.parametrize("level", policy.IMPORTANCE_LEVELS)
@pytest.mark.parametrize("correction", policy.CORRECTIONS)
@pytest.mark.parametrize("num_iterations", [1, 2])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_a_perturbed_engine_changes_the_loss_by_the_weights(loss_type, num_iterations, correction, level):
    """Per token -w min(ρ A, clip(ρ) A) with w from the formulas (1 with none), ρ = exp(π - π_old) and
    π_old = π detached at num_iterations 1: the loss, and at num_iterations 1 the gradient -w A / denominator."""
    logps, mask, old, engine, adv = inputs()
    trainer_old = logps if num_iterations == 1 else old
    w = (formula_weights(trainer_old, engine, mask, correction, level) if correction != "none"
         else [[1.0] * WIDTH] * ROWS)
    per_seq = []
    for i in range(ROWS):
        seq = []
        for t in range(LENGTHS[i]):
            ratio = math.exp(float(logps[i, t] - trainer_old[i, t]))
            a = float(adv[i])
            seq.append(-w[i][t] * min(ratio * a, min(max(ratio, 1 - EPS), 1 + EPS_HIGH) * a))
        per_seq.append(seq)
    tokens = sum(LENGTHS)
    want = (sum(sum(s) / max(len(s), 1) for s in per_seq) / ROWS if loss_type == "grpo"
            else sum(map(sum, per_seq)) / tokens)
    x = logps.clone().requires_grad_()
    sums = policy.policy_sums(x, mask, adv, None if num_iterations == 1 else old, None, loss_type, EPS, EPS_HIGH, 0.0,
                              engine_logps=engine, correction=correction, cap=CAP, level=level)
    loss = policy.objective(sums, policy.policy_counts(mask), loss_type, MAX_LEN)
    assert loss.item() == pytest.approx(want, abs=1e-6)
    plain = policy.policy_sums(logps, mask, adv, None if num_iterations == 1 else old, None, loss_type, EPS,
                               EPS_HIGH, 0.0)
    unweighted = policy.objective(plain, policy.policy_counts(mask), loss_type, MAX_LEN).item()
    assert (loss.item() == pytest.approx(unweighted, abs=1e-7)) == (correction == "none")
    if num_iterations == 1:
        loss.backward()
        n = mask.sum(1, keepdim=True).clamp(min=1).float()
        denom = n * ROWS if loss_type == "grpo" else torch.full_like(n, tokens)
        assert torch.allclose(x.grad, -adv[:, None] * torch.tensor(w) * mask / denom, atol=1e-6)


@pytest.mark.parametrize("level", policy.IMPORTANCE_LEVELS)
@pytest.mark.parametrize("correction", policy.CORRECTIONS)
def test_drift_metrics_equal_the_formulas_whatever_the_split(correction, level):
    logps, mask, old, engine, adv = inputs(seed=2)
    w = formula_weights(old, engine, mask, correction, level)
    diffs = [abs(float(old[i, t] - engine[i, t])) for i in range(ROWS) for t in range(LENGTHS[i])]
    units = ([w[i][t] for i in range(ROWS) for t in range(LENGTHS[i])] if level == "token"
             else [w[i][0] for i in range(ROWS) if LENGTHS[i]])
    want = {"sampling/logprob_diff/mean": sum(diffs) / len(diffs), "sampling/logprob_diff/max": max(diffs),
            "sampling/importance_ratio/min": min(units), "sampling/importance_ratio/mean": sum(units) / len(units),
            "sampling/importance_ratio/max": max(units)}

    def run(parts):
        summed, minima = 0, torch.full((3,), float("inf"))
        for p in parts:
            sums = policy.policy_sums(logps[p], mask[p], adv[p], old[p], None, "dapo", EPS, EPS_HIGH, 0.0,
                                      engine_logps=engine[p], correction=correction, cap=CAP, level=level)
            summed, minima = summed + sums.drift, torch.minimum(minima, sums.drift_minima)
        return policy.drift_metrics(summed, minima)

    for parts in ([slice(0, ROWS)], [slice(0, 2), slice(2, ROWS)], [slice(0, 3), slice(3, 4), slice(4, ROWS)]):
        got = run(parts)
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=1e-5), (k, parts)
    empty = policy.policy_sums(logps[2:3], mask[2:3], adv[2:3], old[2:3], None, "dapo", EPS, EPS_HIGH, 0.0,
                               engine_logps=engine[2:3], correction=correction, cap=CAP, level=level)
    assert set(policy.drift_metrics(empty.drift, empty.drift_minima).values()) == {0.0}  # no trained token


def test_an_engine_that_agrees_logs_no_drift():
    logps, mask, _, _, adv = inputs()
    sums = policy.policy_sums(logps, mask, adv, None, None, "dapo", EPS, EPS_HIGH, 0.0, engine_logps=logps.clone(),
                              correction="tis", cap=CAP)
    got = policy.drift_metrics(sums.drift, sums.drift_minima)
    assert got["sampling/logprob_diff/max"] == 0 and {got[f"sampling/importance_ratio/{k}"]
                                                      for k in ("min", "mean", "max")} == {1.0}


def test_bad_values_name_the_key():
    for key, value in [("grpo.importance_correction", "is"), ("grpo.importance_level", "batch"),
                       ("grpo.importance_cap", 0.0), ("rollout.engine", "tgi")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
            load_config(TINY, [f"{key}={value!r}"], GRPOConfig)
        assert "\n" not in str(e.value)
