"""`reward` (python bench/run.py --only reward): recipes/reward.py vs TRL's RewardTrainer (bench/baselines/trl_reward.py,
TRL's venv) from one causal-LM directory of llama-32k's shape on data/demo/preference.jsonl
(bench/configs/llama-32k-reward.yaml: ddp, 2 ranks, full fine-tuning, centring on): pairs/s (both sides train on
the same pairs per step) and peak memory per rank, --pairs pairs. Target >= 2x pairs/s, memory <= TRL's."""

from __future__ import annotations

from pathlib import Path

import yaml

from benchmarks.base import BENCH, Ctx, SHAPE_32K, describe_shape, ratio
from benchmarks.versus import recipe_vs_trl
from common import REPO, median, pair_order, train_records

RECIPE = REPO / "recipes" / "reward.py"
SHAPE = BENCH / "configs" / "llama-32k-reward.yaml"


def pairs_per_sec(step_end_s: list[float], pairs_per_step: int, warmup: int) -> float:
    """Pairs/s over the steps after `warmup` (step_end_s: each step's end, one clock)."""
    return pairs_per_step * (len(step_end_s) - warmup) / (step_end_s[-1] - step_end_s[warmup - 1])


def bench(ctx: Ctx) -> dict:
    """Pairs/s of recipes/reward.py vs TRL's RewardTrainer from one model directory, ddp, 2 ranks."""
    runs, cfg, steps, warmup = recipe_vs_trl(ctx, "reward", RECIPE, SHAPE, "trl_reward.py",
                                             *((6, 2) if ctx.quick else (20, 5)), 2 if ctx.quick else 5)
    c = yaml.safe_load(cfg.read_text())
    per_step = c["train"]["micro_batch_size"] * c["train"]["grad_accum_steps"] * 2  # 2 ranks
    work = ctx.dir("reward")
    ours = [pairs_per_sec([r["elapsed_s"] for r in train_records(Path(work / f"recipe_{i}"))], per_step, warmup)
            for i in range(len(runs))]
    theirs = [b["useful_tokens_per_sec"] for _, b in runs]  # bench/baselines/trl_reward.py counts pairs
    speed = [a / b for a, b in zip(ours, theirs)]
    mem = [a["mem"] / (b["peak_rss_bytes"] / 2**30) for a, b in runs]
    rows = [f"| pair {i + 1} ({pair_order(i)}) | {a:,.2f} | {b:,.2f} | {s:.2f} | {run[0]['mem']:.2f} / "
            f"{run[1]['peak_rss_bytes'] / 2**30:.2f} |"
            for i, (a, b, s, run) in enumerate(zip(ours, theirs, speed, runs))]
    b = runs[-1][1]
    text = "\n".join(["| | recipe pairs/s | TRL pairs/s | ratio | peak GiB per rank (recipe / TRL) |",
                      "| --- | --- | --- | --- | --- |", *rows,
                      f"| **median** | {median(ours):,.2f} | {median(theirs):,.2f} | **{median(speed):.2f}** | "
                      f"{median(mem):.2f}x |"]) + (
        f"\n\nShape: {describe_shape(SHAPE_32K).split(', seq')[0]}; one random causal-LM directory "
        f"(bench/memory_probe.py --export) that both sides put a score head on. Pairs: {c['data']['path']}, max "
        f"length {c['data']['seq_len']}, micro-batch {c['train']['micro_batch_size']} pairs per rank, 2 ranks gloo, "
        f"DDP, fp32, center_rewards_coefficient {c['reward']['center_rewards_coefficient']}, full fine-tuning. TRL "
        f"{b['trl']} RewardTrainer: gradient checkpointing {b['gradient_checkpointing']} and bf16={b['bf16']} "
        f"(TRL turns both on by default), optimizer {b['optim']}, attention {b['attn_implementation']}, "
        f"{b['wrapper']}; TRL defaults otherwise, in its own venv ({ctx.trl_venv_shown}). {steps} steps, the first "
        f"{warmup} left out; time from rank 0 at the end of each step. Peak memory: peak RSS of the process, max "
        f"over ranks.")
    return {"title": "Reward model: pairs/s vs TRL RewardTrainer", "table": text,
            "ratios": [ratio("reward: recipe / TRL RewardTrainer pairs/s", median(speed), 2.0),
                       ratio("reward: recipe / TRL RewardTrainer peak memory per rank", median(mem), 1.0, "<=")],
            "raw": {"runs": runs, "recipe_pairs_per_sec": ours, "trl_pairs_per_sec": theirs, "ratios": speed,
                    "memory_ratios": mem, "steps": steps, "warmup": warmup, "config": str(SHAPE.relative_to(REPO))}}
