"""`grpo` (python bench/run.py --only grpo): recipes/grpo.py vs TRL's GRPOTrainer (bench/baselines/trl_grpo.py, TRL's
venv) from one model directory of llama-32k's shape on data/demo/prompts.jsonl (bench/configs/llama-32k-grpo.yaml: ddp,
2 ranks, G 4, no vLLM) at 32- and at 256-token completions: completion tokens trained/s (whole steps: sampling included)
and peak memory per rank, --pairs pairs each. Target >= 1.5x at both lengths."""

from __future__ import annotations

import yaml

from benchmarks.base import Ctx, SHAPE_32K, describe_shape, ratio
from benchmarks.versus import GRPO_RECIPE, SHAPE_GRPO, recipe_vs_trl, vs_trl_table
from common import REPO, median


# max_completion_length: (steps, warm-up steps left out, best-window steps); --quick: (5, 2, 2)
LENGTHS = {32: (12, 3, 3), 256: (6, 2, 2)}


def bench(ctx: Ctx) -> dict:
    """Completion tokens trained per second of recipes/grpo.py vs TRL's GRPOTrainer (generation, rewards and
    the update: the whole step), one model directory, ddp, 2 ranks, at each of LENGTHS."""
    texts, ratios, raw = [], [], {}
    for length, plan in LENGTHS.items():
        text, r, raw[length] = versus_trl(ctx, length, *((5, 2, 2) if ctx.quick else plan))
        texts.append(text)
        ratios += r
    return {"title": "GRPO: completion tokens trained/s vs TRL GRPOTrainer", "table": "\n\n".join(texts),
            "ratios": ratios, "raw": raw}


def versus_trl(ctx: Ctx, length: int, steps: int, warmup: int, window: int) -> tuple[str, list[dict], dict]:
    """One length's table, ratios and raw results."""
    versus = recipe_vs_trl(ctx, f"grpo_{length}", GRPO_RECIPE, SHAPE_GRPO, "trl_grpo.py", steps, warmup, window,
                           {"grpo": {"max_completion_length": length}})
    runs, c = versus.runs, yaml.safe_load(versus.config.read_text())
    g = c["grpo"]
    v = vs_trl_table(runs, "GRPOTrainer", "completion tokens trained", window)
    a, b = runs[-1]
    per_rank = c["train"]["micro_batch_size"]
    gen = a["sampling_share"]
    text = v.table + (
        f"\n\nShape: {describe_shape(SHAPE_32K).split(', seq')[0]}; one random model directory "
        f"(bench/benchmarks/memory/probe.py --export) that both sides start from. Prompts: {c['data']['path']} (text), "
        f"{per_rank} completions per rank a step ({per_rank // g['num_generations']} "
        f"prompts x G {g['num_generations']}), max_completion_length {g['max_completion_length']}, temperature "
        f"{g['temperature']}, loss_type {g['loss_type']}, beta {g['beta']}, reward {', '.join(g['reward_funcs'])}, "
        f"2 ranks gloo, DDP, fp32, full fine-tuning, no vLLM on either side. Trained = completion tokens up to and "
        f"including EOS (what carries the loss), all ranks; the random model rarely samples EOS, so nearly every "
        f"completion runs to its maximum on both sides (median per step: recipe "
        f"{median(a['tokens'][warmup:]):,.0f}, TRL {median(b['step_trained_tokens'][warmup:]):,.0f}). A step is "
        f"the whole of it: sampling, rewards, the old/ref log-probs when needed, the update; in the recipe "
        f"sampling took {gen:.0%} of the step (median). TRL {b['trl']} GRPOTrainer: gradient checkpointing "
        f"{b['gradient_checkpointing']} and bf16={b['bf16']} (TRL turns both on by default), use_vllm="
        f"{b['use_vllm']}, generation_batch_size {b['generation_batch_size']}, optimizer {b['optim']}, attention "
        f"{b['attn_implementation']}; TRL defaults otherwise, in its own venv ({ctx.trl_venv_shown}). {steps} "
        f"steps, the first {warmup} left out; time from rank 0 at the end of each step. Peak memory: peak RSS of the "
        f"process, max over ranks. Spread of the per-pair ratios: {max(v.ratios) / min(v.ratios):.2f}x.")
    name = f"grpo at {length} tokens: recipe / TRL GRPOTrainer"
    return (f"**{length}-token completions**\n\n{text}",
            [ratio(f"{name} completion tokens trained/s", median(v.ratios), 1.5),
             ratio(f"{name}, best window", median(v.best), 1.5),
             ratio(f"{name} peak memory per rank", median(v.mem))],
            {"runs": runs, "ratios": v.ratios, "best_window_ratios": v.best, "memory_ratios": v.mem, "steps": steps,
             "warmup": warmup, "config": str(SHAPE_GRPO.relative_to(REPO)), "max_completion_length": length})
