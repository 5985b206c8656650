"""`reward` (python bench/run.py --only reward): recipes/reward.py vs TRL's RewardTrainer
(bench/baselines/trl_reward.py, TRL's venv) from one causal-LM directory of llama-32k's shape on
data/demo/preference.jsonl (bench/configs/llama-32k-reward.yaml: ddp, 2 ranks, full fine-tuning, centring on):
pairs/s (both sides train on the same pairs per step) and peak memory per rank, --pairs pairs. Target >= 2x
pairs/s, memory <= TRL's. Beside them, the floor: bench/baselines/bare_loop.py --reward, the bare DDP loop (forward,
backward, fused AdamW; no data pipeline, metrics or clipping) on the same shape, rows as long as TRL's padded rows: no
trainer of this model can beat TRL by more than the floor's ratio to TRL. The recipe runs in TRL's venv too: at a peak
of ~0.7 GiB the ~50 MB that transformers' own import adds for this repo's dev extras (scipy, torchao) would decide
the memory comparison."""

from __future__ import annotations

import json

import yaml

from benchmarks.base import BASELINES, BENCH, SHAPE_32K, TIMEOUT, Ctx, ratio
from benchmarks.versus import Counted, counted_vs_trl
from common import REPO, median, torchrun

REWARD = Counted("reward", REPO / "recipes" / "reward.py", BENCH / "configs" / "llama-32k-reward.yaml",
                 "trl_reward.py", "RewardTrainer", "pairs", 2.0,
                 lambda c: (f" that both sides put a score head on. Pairs: {c['data']['path']}, max length "
                            f"{c['data']['seq_len']}, micro-batch {c['train']['micro_batch_size']} pairs per rank, 2 "
                            f"ranks gloo, DDP, fp32, center_rewards_coefficient "
                            f"{c['reward']['center_rewards_coefficient']}, full fine-tuning"), in_trl_venv=True)


def bench(ctx: Ctx) -> dict:
    """Pairs/s of recipes/reward.py vs TRL's RewardTrainer from one model directory, ddp, 2 ranks, and the bare
    loop's floor."""
    res = counted_vs_trl(ctx, REWARD)
    trl = [b for _, b in res["raw"]["runs"]]
    length = round(median([b["padded_tokens_per_sec"] / (2 * b["useful_tokens_per_sec"]) for b in trl]))
    steps, warmup = (6, 2) if ctx.quick else (20, 5)

    def bare(tokens: int) -> float:
        out = ctx.dir("reward") / f"bare_{tokens}.json"
        torchrun([BASELINES / "bare_loop.py", "--config", SHAPE_32K, "--strategy", "ddp", "--reward", "--length",
                  tokens, "--steps", steps, "--warmup", warmup, "--every", steps - warmup, "--out", out],
                 timeout=TIMEOUT, log=out.with_suffix(".log"))
        return json.loads(out.read_text())["pairs_per_sec"]

    floor, fixed = bare(length), bare(2)  # rows of 2 tokens: the step's fixed part (all-reduce, AdamW)
    micro = yaml.safe_load(SHAPE_32K.read_text())["train"]["micro_batch_size"]
    theirs, ours = median(res["raw"]["trl_pairs_per_sec"]), median(res["raw"]["recipe_pairs_per_sec"])
    per_step = 2 * micro  # pairs a step, 2 ranks
    res["table"] += (f"\n\nThe floor: bench/baselines/bare_loop.py --reward (DDP forward, backward and fused AdamW of "
                     f"the same shape with a score head, {2 * micro} random rows of {length} tokens per rank, TRL's "
                     f"mean padded length; nothing else) trains {floor:,.2f} pairs/s: {floor / theirs:.2f}x TRL's and "
                     f"{floor / ours:.2f}x the recipe's rate. With rows of 2 tokens its step (the all-reduce and "
                     f"AdamW of every parameter, which any full fine-tuning step does) takes {per_step / fixed:.3f} s; "
                     f"a step at 2x TRL's rate would take {per_step / (2 * theirs):.3f} s, forward and backward "
                     f"included.")
    res["ratios"].append(ratio("reward: bare DDP loop (the floor) / TRL RewardTrainer pairs/s", floor / theirs))
    res["raw"].update(floor_pairs_per_sec=floor, floor_row_length=length, fixed_pairs_per_sec=fixed)
    return {"title": "Reward model: pairs/s vs TRL RewardTrainer", **res}
