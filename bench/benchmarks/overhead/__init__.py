"""`overhead` (python bench/run.py --only overhead): recipes/finetune.py (llama-32k, fsdp2, 2 ranks, gloo) vs
bench/baselines/bare_loop.py, the bare tutorial loop on the same model shape, seq_len, batch and ranks; steady-state
tokens/s after warm-up, --pairs pairs (default 2) in alternating order (A B, B A, ...), median ratio. Target >=
0.97x."""

from __future__ import annotations

import json

from benchmarks.base import BASELINES, Ctx, SHAPE_32K, TIMEOUT, describe_shape, ratio, table
from common import RECIPE, REPO, alternating_pairs, median, pair_order, steady_tokens_per_sec, torchrun, train_records


def bench(ctx: Ctx) -> dict:
    steps, warmup, every, pairs = (6, 2, 2, 1) if ctx.quick else (12, 3, 3, ctx.pairs)
    work = ctx.dir("overhead")
    cfg = SHAPE_32K

    def run_recipe(i: int) -> tuple[float, float]:
        out = work / f"recipe_{i}"
        torchrun([RECIPE, "--config", cfg, f"output_dir={out}", f"train.max_steps={steps}",
                  f"log.every_steps={every}", "log.progress=false", "checkpoint.resume=never"],
                 timeout=TIMEOUT, log=work / f"recipe_{i}.log")
        records = train_records(out)
        return (steady_tokens_per_sec(records, warmup),
                max(r["tokens_per_sec"] for r in records if r["step"] > warmup))

    def run_bare(i: int) -> tuple[float, float]:
        res = work / f"bare_{i}.json"
        torchrun([BASELINES / "bare_loop.py", "--config", cfg, "--steps", steps, "--warmup", warmup, "--every", every,
                  "--out", res], timeout=TIMEOUT, log=work / f"bare_{i}.log")
        b_res = json.loads(res.read_text())
        return b_res["tokens_per_sec"], max(b_res["window_tokens_per_sec"])

    recipe, bare, ratios_, best = [], [], [], []
    for (a, a_best), (b, b_best) in alternating_pairs(pairs, run_recipe, run_bare):
        recipe.append(a)
        bare.append(b)
        ratios_.append(a / b)
        best.append(a_best / b_best)
    shape = f"{describe_shape(cfg)}, fsdp2, 2 ranks gloo"
    rows = [[f"pair {i + 1} ({pair_order(i)})", f"{a:,.0f}", f"{b:,.0f}", f"{a / b:.3f}",
             f"{r:.3f}"] for i, (a, b, r) in enumerate(zip(recipe, bare, best))]
    rows.append(["**median**", f"{median(recipe):,.0f}", f"{median(bare):,.0f}", f"**{median(ratios_):.3f}**",
                 f"{median(best):.3f}"])
    text = table(["run (A = recipe, B = bare)", "recipe tokens/s", "bare loop tokens/s", "recipe / bare",
                  f"best {every}-step window, recipe / bare"], rows)
    spread = max(ratios_) / min(ratios_)
    text += (f"\n\n{shape}; {steps} steps, the first {warmup} left out; tokens = rows x seq_len. Steady tokens/s "
             f"aggregates the windows after warm-up; the last column compares each run's fastest {every}-step "
             "window (less sensitive to bursts of load from other processes on the machine). "
             f"Spread of the per-pair ratios: {spread:.2f}x. The recipe adds real data loading (packed rows "
             "with position_ids, so attention is block-causal: llmtrain/models/attention.py), a token-weighted loss "
             "(train.loss_impl=chunked, the default) with two all-reduces, grad clipping, a preemption all-reduce "
             "and metrics per step, and it uses "
             "fused AdamW; the bare loop reuses one random batch with plain causal attention and torch's "
             "default (per-parameter) AdamW.")
    return {"title": "Framework overhead: recipe vs bare loop", "table": text,
            "ratios": [ratio("overhead: recipe / bare loop tokens/s", median(ratios_), 0.97),
                       ratio("overhead: best window, recipe / bare", median(best), 0.97)],
            "raw": {"recipe_tokens_per_sec": recipe, "bare_tokens_per_sec": bare, "ratios": ratios_,
                    "best_window_ratios": best, "steps": steps, "warmup": warmup, "log_every": every,
                    "config": str(cfg.relative_to(REPO))}}
