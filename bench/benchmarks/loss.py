"""`loss` (python bench/run.py --only loss): the recipe with train.loss_impl=chunked vs full: step time and peak memory
per rank at llama-128k (targets: time <= 1.0x, memory <= 0.6x) and llama-32k (time <= 1.0x); --pairs pairs each."""

from __future__ import annotations

from benchmarks.base import Ctx, SHAPE_128K, SHAPE_32K, TIMEOUT, describe_shape, ratio, table
from common import RECIPE, REPO, alternating_pairs, median, pair_order, steady_tokens_per_sec, torchrun, train_records


def bench(ctx: Ctx) -> dict:
    """train.loss_impl=chunked vs full through the recipe: step time and peak memory per rank."""
    shapes = [("128k", SHAPE_128K, (3, 1) if ctx.quick else (4, 1)),
              ("32k", SHAPE_32K, (6, 2) if ctx.quick else (10, 3))]
    pairs = 1 if ctx.quick else ctx.pairs
    work = ctx.dir("loss")
    rows, ratios_, raw = [], [], {}
    for label, cfg, (steps, warmup) in shapes:
        def run_impl(impl: str):
            def go(i: int) -> tuple[float, float]:
                out = work / f"{label}_{impl}_{i}"
                torchrun([RECIPE, "--config", cfg, f"output_dir={out}", f"train.max_steps={steps}", "log.every_steps=1",
                          "log.progress=false", "checkpoint.resume=never", f"train.loss_impl={impl}"],
                         timeout=TIMEOUT, log=work / f"{label}_{impl}_{i}.log")
                records = train_records(out)
                return steady_tokens_per_sec(records, warmup), max(r["mem_gb"] for r in records)
            return go

        runs = alternating_pairs(pairs, run_impl("chunked"), run_impl("full"))
        time_ratio = median([f[0] / c[0] for c, f in runs])  # chunked step time / full step time
        mem_ratio = median([c[1] / f[1] for c, f in runs])
        for i, (c, f) in enumerate(runs):
            rows.append([f"{label}, pair {i + 1} ({pair_order(i)})", f"{c[0]:,.0f}", f"{f[0]:,.0f}",
                         f"{f[0] / c[0]:.3f}", f"{c[1]:.2f}", f"{f[1]:.2f}", f"{c[1] / f[1]:.2f}"])
        rows.append([f"**{label} median**", "", "", f"**{time_ratio:.3f}**", "", "", f"**{mem_ratio:.2f}**"])
        ratios_.append(ratio(f"loss {label}: chunked / full step time", time_ratio, 1.0, "<="))
        if label == "128k":
            ratios_.append(ratio("loss 128k: chunked / full peak memory per rank", mem_ratio, 0.6, "<="))
        raw[label] = {"runs": runs, "steps": steps, "warmup": warmup, "config": str(cfg.relative_to(REPO)),
                      "shape": describe_shape(cfg)}
    text = table(["run (A = chunked, B = full)", "chunked tokens/s", "full tokens/s", "step time chunked / full",
                  "chunked peak GiB / rank", "full peak GiB / rank", "memory chunked / full"], rows)
    text += ("\n\nThe recipe with train.loss_impl=chunked (A) and full (B), fsdp2, 2 ranks gloo, packed text "
             "(every position trained). Shapes: " + "; ".join(f"**{k}** {v['shape']}, {v['steps']} steps, the first "
                                                         f"{v['warmup']} left out" for k, v in raw.items()) +
             ". Peak memory: the recipe's mem_gb (peak RSS of the process, max over ranks; it includes start-up).")
    return {"title": "Chunked loss vs full logits", "table": text, "ratios": ratios_, "raw": raw}
