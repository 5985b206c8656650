"""recipes/grpo.py with tools end to end: a tiny Llama given a short SFT on data/demo/agent/sft.jsonl (tool-calling
conversations) so that it calls read_code, then GRPO in data/demo/agent/vault.py's environment (2 prompts x 4
trajectories a step, num_iterations 2, the local engine). One process, 2 ranks fsdp2 with another split, 2 ranks fsdp
(lockstep decoding) and 2 ranks ddp stopped at step 3 (in a generation batch) then resumed on one process fsdp2,
sample the same trajectories (their messages) and log the same losses, rewards and tool metrics; the length metrics
count the model's tokens only; the transformers engine's log-probs line up with the trained tokens. An environment
whose reset raises, or whose get_reward returns NaN (the transformers run's environment, from its second generation
batch, after the checkpoint of step 2), stops the run with one line naming its class and the row (exit 1, no export,
the checkpoint intact)."""

from __future__ import annotations

import json
import re

import pytest
from helpers.agents import FLAKY_VAULT, GRPO_CONFIG, REWARDS, SFT_CONFIG
from helpers.grpo import GRPO
from helpers.procs import finish_recipe, read_metrics, run_recipe, start_recipe

from llmtrain.checkpoint import verify

pytestmark = pytest.mark.slow

KEYS = ("loss", "reward", "reward_std", "rewards/digits/mean", "tools/call_frequency", "tools/failure_frequency",
        "tools/mean_turns", "completions/mean_length", "completions/max_length", "completions/clipped_ratio",
        "grad_norm", "trained_tokens")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The runs' folder and the transformers run's result (it stops at step 3 on its environment's NaN reward)."""
    tmp = tmp_path_factory.mktemp("agent")
    (tmp / "sft.yaml").write_text(SFT_CONFIG)
    run_recipe(tmp / "sft", config=tmp / "sft.yaml")
    config = tmp / "grpo.yaml"
    (tmp / "rewards.py").write_text(REWARDS)
    (tmp / "flaky.py").write_text(FLAKY_VAULT)
    config.write_text(GRPO_CONFIG.replace("SFT", str(tmp / "sft" / "hf")).replace("REWARDS", str(tmp / "rewards.py")))
    specs = {"one": (1, ()),
             "transformers": (1, ("rollout.engine=transformers", "train.max_steps=3", "checkpoint.every_steps=2",
                                  f"grpo.environment={tmp / 'flaky.py'}:FlakyVault")),
             "fsdp2": (2, ("parallel.strategy=fsdp2", "train.micro_batch_size=2")),
             "fsdp": (2, ("parallel.strategy=fsdp", "train.grad_accum_steps=1")),  # lockstep: every turn collective
             "part": (2, ("parallel.strategy=ddp", "train.grad_accum_steps=1", "train.max_steps=3",
                          "checkpoint.every_steps=3"))}
    started = {key: start_recipe(tmp / key, *overrides, nproc=nproc, config=config, script=GRPO)
               for key, (nproc, overrides) in specs.items()}
    results = {key: finish_recipe(proc, check=key != "transformers") for key, proc in started.items()}
    resumed = ("parallel.strategy=fsdp2", "train.micro_batch_size=8", "train.grad_accum_steps=1")  # onto 1 process
    run_recipe(tmp / "part", *resumed, config=config, script=GRPO)
    return tmp, results["transformers"]


@pytest.fixture(scope="module")
def runs(launched):
    return launched[0]


def records(out) -> list[dict]:
    """The training steps' records (not the set-up's)."""
    return [r for r in read_metrics(out) if "loss" in r]


def trajectories(out) -> dict[int, list]:
    by_step: dict[int, list] = {}
    for line in (out / "completions.jsonl").read_text().splitlines():
        r = json.loads(line)
        by_step.setdefault(r["step"], []).append((r["prompt_index"], r["generation"], r["messages"], r["reward"]))
    return by_step


@pytest.mark.parametrize("engine", ["one", "transformers"])
def test_tools_are_called_and_lengths_count_the_model_tokens(runs, engine):
    """Trajectories call the tool; the length and tool metrics count what completions.jsonl shows; the engine's
    log-probs line up with the trained tokens (the drift guard's difference is the engines' numerics only)."""
    logged = [json.loads(line) for line in (runs / engine / "completions.jsonl").read_text().splitlines()]
    called = [r for r in logged if any(m["role"] == "tool" for m in r["messages"])]
    assert called and all(r["tool_tokens"] > 0 for r in called)
    assert all(r["messages"][0]["role"] == "assistant" for r in logged)
    first = [r for r in logged if r["step"] == 1]  # both prompts x 4 are logged: the step's whole batch
    step1 = records(runs / engine)[0]
    assert step1["sampling/logprob_diff/max"] < (1e-4 if engine == "one" else 1e-3)
    if engine == "one":  # a reward that differs within groups: the parity below compares real losses
        assert all(r["loss"] != 0 and r["reward_std"] > 0 for r in records(runs / engine))
    assert step1["completions/mean_length"] == pytest.approx(
        sum(r["tokens"] - r["tool_tokens"] for r in first) / len(first))
    calls = sum(len(m.get("tool_calls", [])) for r in first for m in r["messages"])
    assert step1["tools/call_frequency"] == pytest.approx(calls / len(first))
    assert step1["tools/mean_turns"] == pytest.approx(
        sum(sum(m["role"] == "assistant" for m in r["messages"]) for r in first) / len(first))


@pytest.mark.parametrize("other", ["fsdp2", "fsdp", "part"])
def test_same_trajectories_and_losses_at_one_and_two_ranks(runs, other):
    base, got = records(runs / "one"), records(runs / other)
    assert [r["step"] for r in got] == [1, 2, 3, 4] and len(base) == 4
    for a, b in zip(base, got):
        for key in KEYS:
            assert b[key] == pytest.approx(a[key], abs=1e-5, rel=1e-5), (other, a["step"], key)
    assert trajectories(runs / other) == trajectories(runs / "one")


def test_a_failing_reset_stops_the_run_in_one_line(runs, tmp_path):
    env = tmp_path / "env.py"
    env.write_text("class Broken:\n    def reset(self, prompt, **row):\n        raise ValueError('no vault')\n")
    res = run_recipe(tmp_path / "out", f"grpo.environment={env}:Broken", "train.max_steps=1", "parallel.strategy=ddp",
                     config=runs / "grpo.yaml", script=GRPO, nproc=2, check=False)
    assert res.returncode == 1
    lines = [line for line in res.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1
    assert re.match(r"error: Broken.reset raised ValueError: no vault \(prompt index \d+\)", lines[0])
    assert not (tmp_path / "out" / "hf").exists()


def test_a_nan_from_get_reward_stops_the_run_in_one_line_after_its_checkpoint(launched):
    tmp, res = launched
    out = tmp / "transformers"
    assert res.returncode == 1
    lines = [line for line in res.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and 'grpo.py", line' not in res.stderr, res.stderr[-2000:]
    assert re.match(r"error: reward function FlakyVault.get_reward returned nan for prompt index \d+; ", lines[0])
    assert [r["step"] for r in records(out)] == [1, 2]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2"]
    assert verify(out / "checkpoints" / "step_2") == []
    assert not (out / "hf").exists()


def test_plot_draws_the_tool_metrics(runs):
    from llmtrain.plot import panels, read_records

    tools = [p for p in panels(read_records(runs / "one" / "metrics.jsonl")) if p.title == "tools/*"]
    assert [sorted(p.keys) for p in tools] == [["tools/call_frequency", "tools/failure_frequency", "tools/mean_turns"]]
