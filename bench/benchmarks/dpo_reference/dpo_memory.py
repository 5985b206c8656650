"""DPO's reference model and host memory: dpo.precompute_reference vs the live frozen reference, full
fine-tuning, 2 ranks, fsdp2, a ~53M-parameter Llama (vocab 32,000, hidden 512, 6 layers, untied
embeddings; --size 350M: hidden 1024, 24 layers, where the model's shards are more of the peak), the demo
pairs (data/demo/preference.jsonl, the first --pairs of them), the same steps. Prints the peak host memory
per rank (the recipe's mem_gb: peak RSS since start, the max over ranks), what the model's pieces account
for per rank, and the median step time after the first step.

    python bench/benchmarks/dpo_reference/dpo_memory.py [--size 53M|350M] [--steps 4] [--pairs 64] [--out DIR]

Three runs, in this order:
  live                 the frozen copy is built next to the policy and scores each micro-batch in training
  precomputed, cold    the pass scores every pair before the first step (the policy and the frozen copy, no
                       gradients, no optimizer state yet), then frees the copy; training holds one model
  precomputed, warm    the cache the cold run wrote is reused: no reference is ever built
Cold against warm shows whether the pass (rather than training) sets the peak.
The model is saved once as a Hugging Face directory (bench/benchmarks/memory/probe.py --export), so that every run
reads it with the per-rank frugal loader."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/: common, benchmarks

from benchmarks.memory import MEMORY_PROBE
from common import REPO, fmt_bytes, median, run, torchrun, train_records

DPO = REPO / "recipes" / "dpo.py"
SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=512, tie_word_embeddings=False)
SIZES = {"53M": SHAPE,
         "350M": {**SHAPE, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 24,
                  "num_attention_heads": 16}}
SHAPE_QUICK = {**SHAPE, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 4}
RUNS = {"live reference": [], "precomputed, cold cache": ["dpo.precompute_reference=true"],
        "precomputed, warm cache": ["dpo.precompute_reference=true"]}
WORLD = 2


def measure(root: Path, steps: int = 4, pairs: int = 64, quick: bool = False, size: str = "53M") -> dict:
    """Runs RUNS under root; returns {"table": markdown, "ratio": peak precomputed (cold) / live, "raw": ...}."""
    shape = SHAPE_QUICK if quick else SIZES[size]
    steps, pairs = (2, 8) if quick else (steps, pairs)
    model = root / ("model-quick" if quick else f"model-{size}")  # a --out dir can hold several
    if not (model / "model.safetensors").is_file():
        run([sys.executable, MEMORY_PROBE, "--export", model, "--shape", json.dumps(shape)],
            timeout=600)
    # A file of its own (new each time): a datasets cache of its own, so the cold run finds no log-probs.
    data = root / f"pairs-{os.getpid()}.jsonl"
    data.write_text("".join((REPO / "data" / "demo" / "preference.jsonl").read_text().splitlines(True)[:pairs]))
    common = [f"model.path={model}", f"tokenizer.path={REPO / 'assets' / 'tokenizer'}", f"data.path={data}",
              "data.format=preference", "data.seq_len=128", "train.loss_impl=full", "parallel.strategy=fsdp2",
              "train.micro_batch_size=2", f"train.max_steps={steps}", "train.warmup_steps=0", "train.lr=1e-5",
              "log.every_steps=1", "log.progress=false", "distributed.preflight=false", "checkpoint.every_steps=0",
              "dpo.loss=sigmoid", "dpo.beta=0.1"]
    load = os.getloadavg()
    rows = []
    for name, overrides in RUNS.items():
        out_dir = root / re.sub(r"\W+", "_", name)
        shutil.rmtree(out_dir, ignore_errors=True)
        log, _ = torchrun([DPO, f"output_dir={out_dir}", *common, *overrides], nproc=WORLD, timeout=1800,
                          log=out_dir.with_suffix(".log"))
        records = train_records(out_dir)
        n_params = float(re.search(r"model: ([\d.]+)M parameters", log).group(1)) * 1e6
        line = re.search(r"reference log-probs: (computed [\d]+ pairs in [\d.]+ s|reused)", log)
        rows.append({"run": name, "mem_gb": max(r["mem_gb"] for r in records),
                     "step_s": median([r["step_time_s"] for r in records if r["step"] > 1]),
                     "pass": line.group(1) if line else "-", "reference": not overrides})
    load = tuple(max(a, b) for a, b in zip(load, os.getloadavg()))
    shard = n_params * 4 / WORLD  # fp32 bytes of one full model's shard on each rank
    live, cold = rows[0], rows[1]
    lines = ["| run | reference pass | model state / rank (params + grads + AdamW + reference) "
             "| peak host memory / rank | vs live | step time | vs live |", "|" + " --- |" * 7]
    for r in rows:
        state = shard * (5 if r["reference"] else 4)
        lines.append(f"| {r['run']} | {r['pass']} | {fmt_bytes(state)} | {r['mem_gb']:.2f} GiB "
                     f"| {r['mem_gb'] / live['mem_gb']:.2f}x | {r['step_s']:.2f} s "
                     f"| {r['step_s'] / live['step_s']:.2f}x |")
    text = (f"{WORLD} ranks gloo, fsdp2, fp32, {n_params / 1e6:.0f}M parameters (vocab {shape['vocab_size']:,}, "
            f"hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, untied), DPO sigmoid, micro-batch "
            f"2 pairs (data.seq_len 128, the demo pairs: ~30 tokens each), {steps} steps, {pairs} pairs scored by the "
            "pass; "
            "load average (1/5/15 min, the higher of start and end) " + "/".join(f"{x:.1f}" for x in load)
            + f" on {os.cpu_count()} cores\n\n" + "\n".join(lines) +
            f"\n\nModel state per rank: each full model's fp32 shard is {fmt_bytes(shard)}; training holds the "
            "policy, its gradients and two AdamW moments (4 shards), the live run also the frozen copy (a fifth). "
            "Peak RSS adds the imports, the loading peak, activations, logits and all-gather buffers. "
            f"The live run's peak is {fmt_bytes((live['mem_gb'] - cold['mem_gb']) * 2**30)} above the cold "
            f"precomputed run's (one shard: {fmt_bytes(shard)}); with the rest of the peak the same in both, "
            "dropping 1 of 5 shards alone gives 0.8x at best.")
    return {"table": text, "ratio": cold["mem_gb"] / live["mem_gb"],
            "raw": {"rows": rows, "n_params": n_params, "steps": steps, "pairs": pairs, "load": load, "shape": shape}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=SIZES, default="53M", help="the model (350M: ~6 GiB per rank)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--pairs", type=int, default=64, help="demo pairs the pass scores (the training steps use some)")
    p.add_argument("--quick", action="store_true", help="a tiny model: a smoke run (the figures mean little)")
    p.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary directory)")
    args = p.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="bench_dpo_memory_"))
    root.mkdir(parents=True, exist_ok=True)
    print(measure(root, args.steps, args.pairs, args.quick, args.size)["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
