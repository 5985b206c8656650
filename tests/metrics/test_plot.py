"""python -m llmtrain.plot: metrics.jsonl read back (train and eval records, a step logged again after a resume,
a torn last line), the panels it draws for the keys of any recipe (DPO's, GRPO's, a key no recipe logs), the
PNG written, and the command on a real run's output."""

from __future__ import annotations

import json

import pytest

from helpers.procs import launch


BASE_RECORD = {"loss": 0.7, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 1000.0, "mfu": None, "tflops": 0.1,
               "trained_tokens": 400, "skipped_steps": 0, "data_wait_s": 0.0, "elapsed_s": 3.0,
               "tokens_per_sec_per_device": 500.0, "step_time_s": 0.1, "step_time_max_min": 1.1, "mem_gb": 0.6,
               "mem_reserved_gb": None}
DPO_KEYS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected"]
# What recipes/grpo.py logs (its docstring's list) with two reward functions and grpo.beta > 0.
GRPO_KEYS = ["reward", "reward_std", "rewards/format_regex/mean", "rewards/format_regex/std", "rewards/exact/mean",
             "rewards/exact/std", "frac_reward_zero_std", "kl", "completions/mean_length",
             "completions/min_length", "completions/max_length", "completions/clipped_ratio",
             "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
             "clip_ratio/region_mean", "generation_s", "generated_tokens_per_s"]


def write_records(tmp_path, records):
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)) + "\n")
    return plot_panels(tmp_path)


def plot_panels(tmp_path):
    from llmtrain import plot

    return [tuple(p) for p in plot.panels(plot.read_records(tmp_path / "metrics.jsonl"))]


def test_plot_mixed_train_and_eval_records(tmp_path):
    from llmtrain import plot

    records = [{"step": s, "loss": 5 / s, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 1000.0, "mfu": None,
                "tflops": 0.1} for s in range(1, 11)]
    records += [{"step": s, "val_loss": 6 / s, "val_ppl": 2.0} for s in (5, 10)]
    records.append({"step": 10, "loss": 0.4})  # a resumed run logs the step again: the last one wins
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)) + '\n{"step": 11, "lo')
    steps, losses = plot.series(plot.read_records(tmp_path / "metrics.jsonl"), "loss")
    assert steps == list(range(1, 11)) and losses[-1] == 0.4
    assert plot.series(plot.read_records(tmp_path / "metrics.jsonl"), "val_loss") == ([5, 10], [1.2, 0.6])
    assert plot.main([str(tmp_path)]) == 0
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert plot.main([str(tmp_path / "nowhere")]) == 2


def test_plot_panels_follow_the_keys_of_any_recipe(tmp_path, capsys):
    from llmtrain import plot

    records = [{"step": s, **BASE_RECORD, **{k: s / 10 for k in DPO_KEYS}} for s in range(1, 9)]
    records += [{"step": s, "val_loss": 0.6, "val_ppl": 1.8, **{f"val_{k}": 0.5 for k in DPO_KEYS},
                 "val_custom": 3.0, "harness/arc_easy/acc": 0.4, "harness/arc_easy/acc_norm": 0.45,
                 "harness/hellaswag/acc": 0.3} for s in (4, 8)]
    assert write_records(tmp_path, records) == [
        ("Preference accuracy (DPO)", ["rewards/accuracies", "val_rewards/accuracies"]),
        ("Implicit rewards (DPO)", ["rewards/chosen", "rewards/rejected", "rewards/margins", "val_rewards/chosen",
                                    "val_rewards/rejected", "val_rewards/margins"]),
        ("Log-probs (DPO)", ["logps/chosen", "logps/rejected", "val_logps/chosen", "val_logps/rejected"]),
        ("Harness scores", ["harness/arc_easy/acc", "harness/arc_easy/acc_norm", "harness/hellaswag/acc"]),
        ("Perplexity", ["val_ppl"]),
        ("custom", ["val_custom"]),
    ]
    assert plot.panels([{"step": 1, **BASE_RECORD}]) == []  # finetune: the four fixed ones
    assert plot.main([str(tmp_path)]) == 0
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 60_000  # 10 panels
    with pytest.raises(SystemExit):
        plot.main(["--help"])
    assert "run logs the steps after its checkpoint again, and the last record of a step wins.\n\n" in \
        capsys.readouterr().out  # the whole description, not its first line


def test_plot_draws_every_key_grpo_logs_under_its_own_titles(tmp_path):
    from llmtrain import plot

    records = [{"step": s, **BASE_RECORD, **{k: s / 10 for k in GRPO_KEYS}, "my_func/hits": 1.0,
                "my_func/misses": 2.0, "entropy": 0.5} for s in range(1, 5)]
    assert write_records(tmp_path, records) == [
        ("Rewards: total and per function (GRPO)", ["reward", "reward_std", "rewards/format_regex/mean",
                                                    "rewards/format_regex/std", "rewards/exact/mean",
                                                    "rewards/exact/std"]),
        ("Groups with zero reward std, truncated completions (GRPO)",
         ["frac_reward_zero_std", "completions/clipped_ratio"]),
        ("Completion length, tokens (GRPO)",
         ["completions/mean_length", "completions/min_length", "completions/max_length"]),
        ("Clipped token fraction (GRPO)", ["clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean",
                                           "clip_ratio/high_max", "clip_ratio/region_mean"]),
        ("KL to the reference", ["kl"]),
        ("Generation seconds per step (GRPO)", ["generation_s"]),
        ("Generated tokens/s (GRPO)", ["generated_tokens_per_s"]),
        ("my_func/*", ["my_func/hits", "my_func/misses"]),  # a key no recipe here logs: by its prefix
        ("entropy", ["entropy"]),
    ]
    drawn = {k for _, keys in plot.panels(records) for k in keys}
    assert set(records[0]) - drawn - plot.FIXED - plot.BOOKKEEPING == {"step"}  # nothing left out
    assert plot.main([str(tmp_path)]) == 0


@pytest.mark.slow
def test_plot_cli(reference_run, tmp_path):
    out = reference_run
    res = launch(["-m", "llmtrain.plot", out, "--out", tmp_path / "c.png"], timeout=120)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
