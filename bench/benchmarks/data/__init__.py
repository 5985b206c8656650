"""`data` (python bench/run.py --only data): llmtrain.data.build (tokenize + pack, cold datasets cache) on a scaled-up
copy of data/demo/train.jsonl vs the demo's training consumption (tokens/s). Target >= 10x."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from benchmarks.base import Ctx, DEMO, TIMEOUT, ratio, table
from common import RECIPE, run, steady_tokens_per_sec, torchrun, train_records


def bench(ctx: Ctx) -> dict:
    work = ctx.dir("data")
    scale, stream_rows = (1, 200) if ctx.quick else (10, 3000)
    # The demo's consumption (the overhead benchmark runs a larger shape): a short demo run of its own.
    out = work / "demo"
    steps, warmup = (6, 2) if ctx.quick else (20, 10)
    torchrun([RECIPE, "--config", DEMO, f"output_dir={out}", f"train.max_steps={steps}", "log.every_steps=2",
              "log.progress=false", "checkpoint.resume=never"], timeout=TIMEOUT, log=work / "demo.log")
    train_tps = steady_tokens_per_sec(train_records(out), warmup)
    demo_source = f"a {steps}-step demo run of its own (first {warmup} steps left out)"
    cache = work / "hf_cache"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir()
    res = work / "data.json"
    run([sys.executable, Path(__file__).parent / "probe.py", "--src", "data/demo/train.jsonl", "--scale", scale,
         "--workdir", work / "corpus", "--streaming-rows", stream_rows, "--out", res], timeout=TIMEOUT,
        env={"HF_DATASETS_CACHE": str(cache)}, log=work / "data.log")
    d = json.loads(res.read_text())
    build_ratio = d["row_tokens_per_sec"] / train_tps
    stream_ratio = d["stream_row_tokens_per_sec"] / (train_tps / 2)
    rows = [["map-style build (load + tokenize + pack), 1 process", f"{d['row_tokens_per_sec']:,.0f}",
             f"{train_tps:,.0f} (2 ranks)", f"**{build_ratio:.1f}**"],
            ["streaming rows (tokenize + pack on the fly), 1 rank", f"{d['stream_row_tokens_per_sec']:,.0f}",
             f"{train_tps / 2:,.0f} (per rank)", f"{stream_ratio:.1f}"]]
    text = table(["pipeline", "tokens/s", "demo training consumes, tokens/s", "ratio"], rows)
    text += (f"\n\n{d['records']:,} documents ({d['corpus_bytes'] / 2**20:.1f} MiB: data/demo/train.jsonl x {scale}), "
             f"format text, seq_len {d['seq_len']}, packing, cold datasets cache: {d['rows']:,} rows "
             f"({d['real_tokens']:,} real tokens) in {d['build_s']:.1f} s. Streaming: the first "
             f"{d['stream_rows']:,} rows (shuffle buffer 1000). Tokens are rows x seq_len on both sides. "
             f"Consumption: the recipe's steady tokens/s on configs/demo.yaml, from {demo_source}. "
             "Streaming tokenizes in the training loop of every rank (not overlapped with compute), so it "
             f"costs about 1/{stream_ratio:.0f} of the step time.")
    return {"title": "Data pipeline vs training consumption", "table": text,
            "ratios": [ratio("data: build tokens/s / demo training tokens/s", build_ratio, 10.0),
                       ratio("data: streaming per rank / training per rank", stream_ratio, None)],
            "raw": {**d, "demo_tokens_per_sec": train_tps}}
