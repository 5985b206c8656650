"""recipes/grpo.py end to end on a tiny random Llama and data/demo/prompts.jsonl (3 prompts x 4 completions a step, a
reward of the completion's length): the step-1 loss and every metric equal the formulas computed from the
completions it logged, for each loss type (dapo, beta > 0, num_iterations 2, one process; dr_grpo with LoRA, beta 0,
one iteration, one process; grpo, beta 0, one iteration, 2 ranks ddp; bnpo, beta > 0, num_iterations 2, 2 ranks
fsdp2; on 2 ranks a group straddles them); one process without a wrapper and 2 ranks under fsdp2, fsdp and ddp, with
other micro-batch / accumulation splits and a group straddling the two ranks, sample the same completions and log
the same losses and metrics over 5 steps, LoRA too; a run stopped at step 3 (in the middle of a generation batch) on
2 ranks ddp and resumed on 1 process fsdp2 continues as the uninterrupted run; a reward function that raises or
returns the wrong length stops the run with one line naming it and the prompt (exit 1, no checkpoint, no export); a
missing one exits 2 before any process starts."""

from __future__ import annotations

import json
import math
import re
import time

import pytest

from helpers.grpo import GRPO, write_config
from helpers.procs import finish_recipe, read_metrics, run_recipe, start_recipe

KEYS = ("loss", "reward", "reward_std", "rewards/chars/mean", "rewards/chars/std", "frac_reward_zero_std",
        "completions/mean_length", "completions/min_length", "completions/max_length", "completions/clipped_ratio",
        "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "grad_norm", "trained_tokens")
LORA = ("lora.enabled=true", "lora.r=4", "lora.dropout=0",  # dropout: per-rank randomness
        "grpo.loss_type=dr_grpo", "grpo.beta=0.0", "grpo.num_iterations=1")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo")
    return tmp, write_config(tmp)


@pytest.fixture(scope="module")
def runs(setup):
    tmp, config = setup
    two = ("train.micro_batch_size=3",)  # rank 0: the first group and half the second
    specs = {
        "one": (1, ()),
        "fsdp2": (2, ("parallel.strategy=fsdp2", *two)),
        "fsdp": (2, ("parallel.strategy=fsdp", "train.grad_accum_steps=1")),
        "part": (2, ("parallel.strategy=ddp", "train.micro_batch_size=1", "train.grad_accum_steps=6",
                     "train.max_steps=3", "checkpoint.every_steps=3")),
        "lora_one": (1, LORA),
        "lora_two": (2, (*LORA, "parallel.strategy=ddp", *two)),
        "grpo_two": (2, ("parallel.strategy=ddp", *two, "grpo.loss_type=grpo", "grpo.beta=0.0",
                         "grpo.num_iterations=1", "train.max_steps=1")),
        "bnpo_two": (2, ("parallel.strategy=fsdp2", *two, "grpo.loss_type=bnpo", "train.max_steps=1")),
    }
    running = []
    for key, (nproc, overrides) in specs.items():  # two at a time: a tiny run spends most of its time starting
        if len(running) == 2:
            finish_recipe(running.pop(0))
        running.append(start_recipe(tmp / key, *overrides, nproc=nproc, config=config, script=GRPO))
    for proc in running:
        finish_recipe(proc)
    run_recipe(tmp / "part", "parallel.strategy=fsdp2", "train.micro_batch_size=12", "train.grad_accum_steps=1",
               config=config, script=GRPO)
    return tmp


def records(out) -> list[dict]:
    return [r for r in read_metrics(out) if "loss" in r]


def completions(out) -> list[dict]:
    return [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]


def std(x: list[float]) -> float:
    mean = sum(x) / len(x)
    return math.sqrt(sum((v - mean) ** 2 for v in x) / (len(x) - 1))


def expected_step_1(logged: list[dict], loss_type: str, max_len: int) -> dict:
    """Every step-1 metric from the completions alone: at step 1 the ratio is 1 (and the KL 0: the
    reference is the starting point), so the loss is -Σ A_i n_i over the loss type's denominator, or for grpo
    the mean over completions of each one's token mean, -A_i."""
    rewards = [len(r["completion"].strip()) / 10 for r in logged]
    assert rewards == pytest.approx([r["rewards"]["chars"] for r in logged], abs=1e-12)
    adv, zero = [], []
    for g in range(0, len(rewards), 4):
        group = rewards[g:g + 4]
        s = std(group)
        adv += [(r - sum(group) / 4) / (s + 1e-4) for r in group]
        zero += [s < 1e-8] * 4
    assert adv == pytest.approx([r["advantage"] for r in logged], abs=1e-5)
    n = [r["tokens"] for r in logged]
    weighted = -sum(a * k for a, k in zip(adv, n))
    loss = {"dapo": weighted / sum(n), "bnpo": weighted / sum(n), "dr_grpo": weighted / (len(n) * max_len),
            "grpo": -sum(adv) / len(adv)}[loss_type]
    return {"loss": loss, "reward": sum(rewards) / len(rewards), "reward_std": std(rewards),
            "rewards/chars/mean": sum(rewards) / len(rewards), "rewards/chars/std": std(rewards),
            "frac_reward_zero_std": sum(zero) / len(zero), "completions/mean_length": sum(n) / len(n),
            "completions/min_length": min(n), "completions/max_length": max(n),
            "completions/clipped_ratio": sum(r["truncated"] for r in logged) / len(logged),
            "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.0, "clip_ratio/region_mean": 0.0,
            "trained_tokens": sum(n)}


@pytest.mark.slow
@pytest.mark.parametrize("run, loss_type", [("one", "dapo"), ("lora_one", "dr_grpo"), ("grpo_two", "grpo"),
                                           ("bnpo_two", "bnpo")])
def test_step_1_equals_the_formulas_from_the_logged_completions(runs, run, loss_type):
    logged = [r for r in completions(runs / run) if r["step"] == 1]
    assert len(logged) == 12 and [r["generation"] for r in logged] == [0, 1, 2, 3] * 3
    first = records(runs / run)[0]
    for key, value in expected_step_1(logged, loss_type, 12).items():
        assert first[key] == pytest.approx(value, abs=1e-5), key
    assert first["loss"] != 0 and ("kl" in first) == (run in ("one", "bnpo_two"))
    if run == "one":
        assert first["kl"] == pytest.approx(0, abs=1e-6)
        later = records(runs / run)
        assert any(r["kl"] > 1e-6 for r in later) and any(r["clip_ratio/region_mean"] > 0 for r in later)
        # num_iterations 2: step 2 trains on step 1's completions (the same reward metrics, none sampled)
        assert later[1]["reward"] == first["reward"] and {r["step"] for r in completions(runs / run)} == {1, 3, 5}


@pytest.mark.slow
@pytest.mark.parametrize("base, other", [("one", "fsdp2"), ("one", "fsdp"), ("lora_one", "lora_two")])
def test_two_ranks_and_other_splits_sample_and_train_the_same(runs, base, other):
    a, b = records(runs / base), records(runs / other)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4, 5]
    for x, y in zip(a, b):
        for k in KEYS + (("kl",) if "kl" in x else ()):
            assert x[k] == pytest.approx(y[k], abs=2e-5), (x["step"], k)
    texts = [(r["step"], r["prompt_index"], r["generation"], r["completion"]) for r in completions(runs / base)]
    assert texts == [(r["step"], r["prompt_index"], r["generation"], r["completion"])
                     for r in completions(runs / other)]


@pytest.mark.slow
def test_resume_in_a_generation_batch_onto_another_world_size_and_strategy(runs):
    whole, resumed = records(runs / "one"), records(runs / "part")
    by_step = {r["step"]: r for r in resumed}  # the resumed run logs steps 4 and 5 after the first part's 1-3
    assert sorted(by_step) == [1, 2, 3, 4, 5]
    for x in whole:
        for k in KEYS + ("kl",):
            assert x[k] == pytest.approx(by_step[x["step"]][k], abs=2e-5), (x["step"], k)
    assert [r["completion"] for r in completions(runs / "part") if r["step"] == 5] == \
        [r["completion"] for r in completions(runs / "one") if r["step"] == 5]


@pytest.mark.slow
@pytest.mark.parametrize("func, nproc, message", [
    ("fails", 2, "raised ZeroDivisionError: division by zero (prompt index "),
    ("short", 1, "returned 1 rewards for 12 completions (prompts "),
    ("nan_one", 2, "returned nan for prompt index "),
])
def test_a_failing_reward_function_stops_with_one_line(setup, func, nproc, message):
    tmp, config = setup
    spec = f"{tmp / 'rewards.py'}:{func}"
    out = tmp / f"fail_{func}"
    res = run_recipe(out, f"grpo.reward_funcs=[{spec}]", "checkpoint.every_steps=1",
                     f"parallel.strategy={'ddp' if nproc > 1 else 'none'}", nproc=nproc, config=config,
                     script=GRPO, check=False, torchrun=nproc > 1)
    assert res.returncode == 1
    lines = [line for line in res.stderr.splitlines() if "reward function" in line]
    assert lines and all(f"reward function {spec} {message}" in line for line in lines), res.stderr[-2000:]
    assert 'grpo.py", line' not in res.stderr  # no traceback from the workers (torchrun prints its own)
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    assert not (out / "hf").exists() and not (out / "completions.jsonl").exists()


def test_missing_reward_function_exits_2_before_start(setup, run_setup):
    tmp, config = setup
    spec = f"{tmp / 'rewards.py'}:nope"
    code, _, err = run_setup(GRPO, "--config", config, f"output_dir={tmp / 'missing'}", f"grpo.reward_funcs=[{spec}]")
    assert code == 2 and f"{spec!r}: " in err and "has no function 'nope'" in err
    assert not (tmp / "missing").exists()


@pytest.mark.slow
def test_groups_that_do_not_divide_the_step_exit_2_before_preflight(setup):
    """The step's completions (micro x accumulation x ranks, the world size from torchrun's environment) must
    be whole groups: checked at set-up, before the process group, preflight and the model."""
    tmp, config = setup
    out = tmp / "groups"
    res = run_recipe(out, "parallel.strategy=ddp", "train.micro_batch_size=3", "train.grad_accum_steps=1",
                     "distributed.preflight=true", nproc=2, config=config, script=GRPO, check=False, torchrun=True)
    # Each worker exits 2 (torchrun itself exits 1 when a worker fails, naming the workers' code).
    assert res.returncode != 0 and re.search(r"exitcode\s*:\s*2\b", res.stderr), res.stderr[-2000:]
    assert ("train.micro_batch_size x train.grad_accum_steps x 2 ranks = 6 completions per step must be a multiple "
            "of grpo.num_generations = 4") in res.stderr
    assert "preflight ok" not in res.stdout + res.stderr and not out.exists()


@pytest.mark.slow
def test_a_step_where_every_reward_is_none_says_so_and_metrics_stay_json(setup):
    tmp, config = setup
    out = tmp / "never"
    res = run_recipe(out, f"grpo.reward_funcs=[{tmp / 'rewards.py'}:never]", "train.max_steps=1", config=config,
                     script=GRPO)
    assert f"step 1: every reward function ({tmp / 'rewards.py'}:never) returned None (not applicable) for all 12 " \
           "completions (prompts " in res.stdout
    (record,) = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))
                 for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert record["rewards/never/mean"] is None and record["reward"] is None  # NaN means, written as null


def timed_run(tmp, config, name: str, *overrides: str):
    start = time.monotonic()
    res = run_recipe(tmp / name, f"grpo.reward_funcs=[{tmp / 'rewards.py'}:{name}]", "parallel.strategy=ddp",
                     "checkpoint.every_steps=1", *overrides, nproc=2, config=config, script=GRPO, check=False,
                     torchrun=True)  # a rank stuck or dead: torchrun's agent and its report are part of what is tested
    return res, time.monotonic() - start


@pytest.mark.slow
def test_a_reward_function_hanging_on_one_rank_stops_every_rank_naming_it_and_the_rank(setup):
    tmp, config = setup
    res, seconds = timed_run(tmp, config, "hangs", "grpo.reward_timeout_s=1", "distributed.timeout_s=120")
    assert res.returncode == 1 and seconds < 100, (seconds, res.stderr[-2000:])
    errors = [line for line in res.stderr.splitlines() if line.startswith("error")]
    assert errors[0].startswith(f"error: reward function {tmp / 'rewards.py'}:hangs did not return within "
                                "grpo.reward_timeout_s=1 s on rank 1 (prompts "), res.stderr[-2000:]
    assert len(errors) == 1 and "Timed out waiting" not in res.stderr
    assert not (tmp / "hangs" / "checkpoints").exists() or not any((tmp / "hangs" / "checkpoints").iterdir())


@pytest.mark.slow
def test_a_collective_that_times_out_says_which_and_where(setup):
    tmp, config = setup
    res, _ = timed_run(tmp, config, "hangs_unstoppably", "grpo.reward_timeout_s=3", "distributed.timeout_s=10")
    assert res.returncode == 1
    errors = [line for line in res.stderr.splitlines() if line.startswith("error")]
    assert errors[0].startswith("error: rank 0 timed out after 10 s (distributed.timeout_s) waiting for a peer "
                                "(no rank on this node died: one is stuck "), res.stderr[-3000:]
    assert " at all_gather_object in llmtrain/rewards.py:" in errors[0] and "(score_everywhere)" in errors[0]


@pytest.mark.slow
def test_the_local_engine_does_not_drift(runs):
    """The local sampler's log-probs are the trainer's (fp32, no top-k / top-p): the drift guard logs ~0
    differences and importance ratios ~1 at every step, every strategy, resumed or not."""
    for run in ("one", "fsdp2", "fsdp", "part", "lora_two"):
        for r in records(runs / run):
            assert 0 <= r["sampling/logprob_diff/mean"] <= r["sampling/logprob_diff/max"] < 1e-4, (run, r["step"])
            for k in ("min", "mean", "max"):
                assert r[f"sampling/importance_ratio/{k}"] == pytest.approx(1, abs=1e-4), (run, r["step"], k)
