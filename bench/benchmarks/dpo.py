"""`dpo` (python bench/run.py --only dpo): recipes/dpo.py vs TRL's DPOTrainer (bench/baselines/trl_dpo.py, TRL's venv)
from one model directory of llama-32k's shape on data/demo/preference.jsonl (bench/configs/llama-32k-dpo.yaml: ddp, 2
ranks, sigmoid, live frozen reference, full fine-tuning): response tokens/s and peak memory per rank, --pairs pairs.
Target >= 1.3x."""

from __future__ import annotations

import yaml

from benchmarks.base import Ctx, SHAPE_32K, describe_shape, ratio
from benchmarks.versus import DPO_RECIPE, SHAPE_DPO, recipe_vs_trl, vs_trl_table
from common import REPO, median


def bench(ctx: Ctx) -> dict:
    """Useful (response) tokens/s of recipes/dpo.py vs TRL's DPOTrainer from one model directory, ddp, 2 ranks."""
    steps, warmup, window = (6, 2, 2) if ctx.quick else (20, 5, 5)
    versus = recipe_vs_trl(ctx, "dpo", DPO_RECIPE, SHAPE_DPO, "trl_dpo.py", steps, warmup, window)
    runs, c = versus.runs, yaml.safe_load(versus.config.read_text())
    v = vs_trl_table(runs, "DPOTrainer", "response tokens", window)
    a, b = runs[-1]
    text = v.table + (
        f"\n\nShape: {describe_shape(SHAPE_32K).split(', seq')[0]}; one random model "
        f"directory (bench/benchmarks/memory/probe.py --export) that both sides start from, for the policy and the "
        f"frozen "
        f"reference. Pairs: {c['data']['path']} (text form), max length {c['data']['seq_len']}, micro-batch "
        f"{c['train']['micro_batch_size']} pairs per rank (chosen + rejected rows in one forward, padded to the "
        f"longest row), 2 ranks gloo, DDP, fp32, sigmoid loss, beta {c['dpo']['beta']}, live frozen reference, "
        f"full fine-tuning. Useful = response tokens of chosen and rejected rows (what "
        f"carries a log-prob), all ranks: per step the two sides counted "
        f"{'the same tokens (same pairs in the same order)' if v.same_tokens else 'different tokens'}, median "
        f"{median(a['tokens'][warmup:]):,.0f}. Recipe: recipes/dpo.py, train.loss_impl default. TRL {b['trl']} "
        f"DPOTrainer: activation checkpointing {b['activation_checkpointing']} and bf16={b['bf16']} (TRL turns both "
        f"on by default), precompute_ref_log_probs={b['precompute_ref_log_probs']}, padding_free="
        f"{b['padding_free']} (TRL's defaults), truncation {b['truncation_mode']}, optimizer {b['optim']}, "
        f"attention {b['attn_implementation']}, {b['wrapper']} with find_unused_parameters="
        f"{b['find_unused_parameters']} (transformers' default without gradient checkpointing); TRL defaults "
        f"otherwise, in its own venv ({ctx.trl_venv_shown}). {steps} steps, the first {warmup} left out; time from "
        f"rank 0 at the end of each step. Peak memory: peak RSS of the process, max over ranks. Spread of the per-pair "
        f"ratios: {max(v.ratios) / min(v.ratios):.2f}x.")
    return {"title": "DPO: response tokens/s vs TRL DPOTrainer", "table": text,
            "ratios": [ratio("dpo: recipe / TRL DPOTrainer response tokens/s", median(v.ratios), 1.3),
                       ratio("dpo: best window, recipe / TRL DPOTrainer", median(v.best), 1.3),
                       ratio("dpo: recipe / TRL DPOTrainer peak memory per rank", median(v.mem))],
            "raw": {"runs": runs, "ratios": v.ratios, "best_window_ratios": v.best, "memory_ratios": v.mem,
                    "same_tokens": v.same_tokens, "steps": steps, "warmup": warmup,
                    "config": str(SHAPE_DPO.relative_to(REPO))}}
