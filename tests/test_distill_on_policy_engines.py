"""On-policy distillation (recipes/distill.py, distill.on_policy_fraction) with its engine from the rollout:
section: rollout.engine=transformers on 2 ranks (fsdp2 with accumulation: the student's full weights gathered and
pushed into every rank's copy, fingerprint-checked, before each on-policy step) trains, and the engine's log-probs
of the sampled tokens match the student's own (logged as GRPO's drift guard logs them, sampling/logprob_diff/*)
within GRPO's tolerance for this engine (tests/test_grpo_engine_runs.py)."""

from __future__ import annotations

import math

import pytest

from helpers.distill import DISTILL
from helpers.on_policy import COMPLETIONS, FSDP2_ACCUM, on_policy_args
from helpers.procs import read_metrics, run_recipe


@pytest.fixture(scope="module")
def transformers_run(tmp_path_factory, base):
    out = tmp_path_factory.mktemp("distill-on-policy-engine") / "run"
    run_recipe(out, *on_policy_args(base, 1, *FSDP2_ACCUM, "rollout.engine=transformers"), nproc=2, script=DISTILL)
    return out


@pytest.mark.slow
def test_transformers_engine_trains_with_its_logprobs_matching_the_students(transformers_run):
    logged = {r["step"]: r for r in read_metrics(transformers_run) if "loss" in r}
    assert sorted(logged) == [1, 2, 3, 4]
    for step, r in logged.items():
        assert r["on_policy"] == 1 and all(k in r for k in COMPLETIONS), step
        assert all(math.isfinite(r[k]) for k in ("loss", "kd_loss", "ce_loss", "grad_norm")) and r["grad_norm"] > 0
        # The trained tokens are the completions' (4 rows a step), every one drift-checked.
        assert r["trained_tokens"] == round(4 * r["completions/mean_length"]), r
        assert 0 <= r["sampling/logprob_diff/mean"] <= r["sampling/logprob_diff/max"] < 1e-5, (step, r)
    assert len({r["loss"] for r in logged.values()}) == 4  # the weights moved: each step sampled and trained anew
