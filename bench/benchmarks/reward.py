"""`reward` (python bench/run.py --only reward): recipes/reward.py vs TRL's RewardTrainer
(bench/baselines/trl_reward.py, TRL's venv) from one causal-LM directory of llama-32k's shape on
data/demo/preference.jsonl (bench/configs/llama-32k-reward.yaml: ddp, 2 ranks, full fine-tuning, centring on):
pairs/s (both sides train on the same pairs per step) and peak memory per rank, --pairs pairs. Target >= 2x
pairs/s, memory <= TRL's."""

from __future__ import annotations

from benchmarks.base import BENCH, Ctx
from benchmarks.versus import Counted, counted_vs_trl
from common import REPO

REWARD = Counted("reward", REPO / "recipes" / "reward.py", BENCH / "configs" / "llama-32k-reward.yaml",
                 "trl_reward.py", "RewardTrainer", "pairs", 2.0,
                 lambda c: (f" that both sides put a score head on. Pairs: {c['data']['path']}, max length "
                            f"{c['data']['seq_len']}, micro-batch {c['train']['micro_batch_size']} pairs per rank, 2 "
                            f"ranks gloo, DDP, fp32, center_rewards_coefficient "
                            f"{c['reward']['center_rewards_coefficient']}, full fine-tuning"))


def bench(ctx: Ctx) -> dict:
    """Pairs/s of recipes/reward.py vs TRL's RewardTrainer from one model directory, ddp, 2 ranks."""
    return {"title": "Reward model: pairs/s vs TRL RewardTrainer", **counted_vs_trl(ctx, REWARD)}
