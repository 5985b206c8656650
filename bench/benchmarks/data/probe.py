"""Data pipeline speed (bench/run.py, "data"): llmtrain.data.build on a scaled-up copy of a corpus,
from a cold datasets cache (run it with HF_DATASETS_CACHE pointing at an empty directory).

    HF_DATASETS_CACHE=$(mktemp -d) python bench/benchmarks/data/probe.py --src data/demo/train.jsonl --scale 10 \
        --workdir DIR --out R.json [--streaming-rows N]

map-style  data.build (load_dataset json -> arrow, tokenize map, pack map): one process, as rank 0
           does it before training (the other ranks wait, then read the cache)
streaming  StreamingRows(...).rows(0) of one rank of a world of 1: read, tokenize and pack on the
           fly, the work every rank does during training with data.streaming=true
Tokens are counted as rows x seq_len, as the recipe's tokens_per_sec counts them; the input tokens
(rows x seq_len minus the padding) are reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/: common, benchmarks

from common import REPO

TOKENIZER = REPO / "assets" / "tokenizer"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--src", default="data/demo/train.jsonl")
    p.add_argument("--scale", type=int, default=10)
    p.add_argument("--format", default="text")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--streaming-rows", type=int, default=2000, help="rows to draw in the streaming test; 0 skips")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if "HF_DATASETS_CACHE" not in os.environ:
        raise SystemExit("set HF_DATASETS_CACHE to an empty directory (a cold cache is what is measured)")

    args.workdir.mkdir(parents=True, exist_ok=True)
    corpus = args.workdir / f"scaled{Path(args.src).suffix}"
    lines = Path(args.src).read_text().splitlines()
    with open(corpus, "w") as f:
        for _ in range(args.scale):
            f.write("\n".join(lines) + "\n")
    n_records = len(lines) * args.scale

    from llmtrain import data
    from llmtrain.config import DataConfig
    from llmtrain.models.hf import load_tokenizer

    tokenizer = load_tokenizer(str(TOKENIZER), False)
    section = DataConfig(path=str(corpus), format=args.format, seq_len=args.seq_len, packing=True)
    t0 = time.perf_counter()
    built = data.build(section, tokenizer, seed=0)
    build_s = time.perf_counter() - t0
    rows = len(built.train)
    table = built.train[:]  # torch format: a dict of (rows, seq_len) tensors
    pads = (table["labels"] == -100) & (table["input_ids"] == tokenizer.pad_token_id)
    real_tokens = rows * args.seq_len - int(pads.sum())
    result = {"records": n_records, "corpus_bytes": corpus.stat().st_size, "seq_len": args.seq_len,
              "build_s": build_s, "rows": rows, "row_tokens": rows * args.seq_len,
              "row_tokens_per_sec": rows * args.seq_len / build_s, "real_tokens": real_tokens,
              "examples": built.stats.num_examples}

    if args.streaming_rows:
        stream_section = DataConfig(path=str(corpus), format=args.format, seq_len=args.seq_len, packing=True,
                                    streaming=True, shuffle_buffer=1000)
        stream = data.StreamingRows(stream_section, tokenizer, 0, 0, 1)
        t0 = time.perf_counter()
        n = 0
        for _ in stream.rows(0):
            n += 1
            if n >= args.streaming_rows:
                break
        stream_s = time.perf_counter() - t0
        result.update({"stream_rows": n, "stream_s": stream_s,
                       "stream_row_tokens_per_sec": n * args.seq_len / stream_s})
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
