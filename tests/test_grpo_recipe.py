"""The DRAFT recipes/grpo.py on a tiny random Llama and data/demo/prompts.jsonl: one process without a wrapper
(2 micro-batches) and 2 ranks under FSDP2 (1 each, the groups of 4 straddling the ranks) log the same losses,
rewards and policy metrics over 3 steps with beta > 0 and num_iterations 2; a missing reward function exits
2 before any process starts; one that raises stops the run with one line naming it and the prompt index."""

from __future__ import annotations

import pytest

from helpers import REPO
from helpers.procs import read_metrics, run_recipe

GRPO = REPO / "recipes" / "grpo.py"
CONFIG = """\
model:
  config: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
           num_key_value_heads: 2, max_position_embeddings: 64, tie_word_embeddings: true}
tokenizer: {path: assets/tokenizer}
data: {path: data/demo/prompts.jsonl, seq_len: 64}
parallel: {strategy: none}
train: {max_steps: 3, micro_batch_size: 4, grad_accum_steps: 2, lr: 1.0e-3, warmup_steps: 1, seed: 7}
grpo: {num_generations: 4, max_completion_length: 16, beta: 0.04, num_iterations: 2, reward_funcs: [REWARD]}
log: {every_steps: 1, progress: false}
"""
KEYS = ("loss", "reward", "reward_std", "kl", "clip_ratio/region_mean", "clip_ratio/high_max",
        "completions/mean_length", "frac_reward_zero_std", "grad_norm")


@pytest.fixture
def config(tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def chars(prompts, completions, completion_ids, **kw):\n"
                       "    return [len(c.strip()) / 10 for c in completions]\n"
                       "def fails(prompts, completions, completion_ids, answer, **kw):\n"
                       "    return [1 / (int(a) != 9) for a in answer]\n")
    path = tmp_path / "grpo.yaml"
    path.write_text(CONFIG.replace("REWARD", f"{rewards}:chars"))
    return path, rewards


@pytest.mark.slow
def test_one_and_two_ranks_log_the_same_steps(tmp_path, config):
    path, _ = config
    run_recipe(tmp_path / "one", config=path, script=GRPO)
    run_recipe(tmp_path / "two", "parallel.strategy=fsdp2", "train.grad_accum_steps=1", nproc=2, config=path,
               script=GRPO)
    one, two = (read_metrics(tmp_path / d) for d in ("one", "two"))
    one, two = ([r for r in m if "loss" in r] for m in (one, two))
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3]
    assert any(r["kl"] > 0 for r in one) and any(r["loss"] != 0 for r in one)
    for a, b in zip(one, two):
        for k in KEYS:
            assert a[k] == pytest.approx(b[k], abs=2e-5), (a["step"], k)


def test_missing_reward_function_exits_2_before_start(tmp_path, config):
    path, rewards = config
    res = run_recipe(tmp_path / "out", f"grpo.reward_funcs=[{rewards}:nope]", config=path, script=GRPO,
                     torchrun=False, check=False)
    assert res.returncode == 2 and f"{rewards}:nope" in res.stderr and "has no function 'nope'" in res.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_raising_reward_function_stops_with_one_line(tmp_path, config):
    path, rewards = config
    res = run_recipe(tmp_path / "out", f"grpo.reward_funcs=[{rewards}:fails]", "train.max_steps=40", config=path,
                     script=GRPO, check=False)
    assert res.returncode != 0
    line = next(l for l in res.stderr.splitlines() if "reward function" in l)
    assert f"{rewards}:fails raised ZeroDivisionError" in line and "prompt index" in line
