"""Long rows on CPU: Ulysses sequence parallelism (parallel.sp_size 2 on 2 processes) vs one process, side by side.

The llama-32k shape (bench/configs/llama-32k.yaml: vocabulary 32,000, hidden 256, 4 layers, 8 heads / 4 key/value
heads) on one packed row of L tokens per step (data/demo/train.jsonl), the chunked loss; a ladder of L. Each run
reports its peak host memory per rank (the recipe's mem_gb: peak RSS, the max over ranks) and its median step
time after the first step. Against a per-process budget (--budget-gib):
  - memory: at L1, the longest L of the ladder that one process trains within the budget, peak per rank at
    sp_size 2 / one process (target <= 0.6x);
  - length: L2, the longest L that sp_size 2 trains within the same budget per process, / L1 (target >= 1.8x).
A series stops at its first L over the budget. The one process runs parallel.strategy=none (all of the training
state in it), the two run fsdp2 (the state sharded: a part of the saving that is not the split's). Both run with
glibc's MALLOC_MMAP_THRESHOLD_ fixed (--mmap-threshold-mib, default 1): glibc otherwise raises its threshold as
large blocks are freed and serves later tensors from a heap it does not give back, so peak RSS holds memory no
tensor uses (what a GPU's allocated-memory peak would not count); 0 leaves glibc's default.

    python bench/benchmarks/longctx/longctx.py [--lengths 49152,65536,...] [--budget-gib 10] [--steps 3] [--out DIR]
    python bench/benchmarks/longctx/longctx.py --quick    # a smoke run: two short lengths

The defaults take about an hour and two processes of up to --budget-gib each: 24 GiB of memory, or lower both.
Timed runs need an idle machine (the step times and, through the allocator, the peaks move with the load).
A run's first step can take minutes more the first time the machine's page cache must make room for it: the
step time is the median of the later steps."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/: common, benchmarks

from common import RECIPE, REPO, median, run, torchrun, train_records

SHAPE = REPO / "bench" / "configs" / "llama-32k.yaml"
LENGTHS = (49152, 65536, 98304, 131072, 196608)
SERIES = {  # name: (processes, overrides)
    "1 process": (1, ["parallel.strategy=none"]),
    "sp_size 2": (2, ["parallel.strategy=fsdp2", "parallel.sp_size=2"]),
}


class Result(NamedTuple):
    length: int
    peak_gib: float
    step_s: float


def train(out: Path, series: str, length: int, steps: int, env: dict) -> Result:
    nproc, overrides = SERIES[series]
    shutil.rmtree(out, ignore_errors=True)
    args = [RECIPE, "--config", SHAPE, f"output_dir={out}", f"data.seq_len={length}",
            f"model.config.max_position_embeddings={length}", "train.micro_batch_size=1", f"train.max_steps={steps}",
            "train.warmup_steps=0", "train.loss_impl=chunked", "log.every_steps=1", "log.progress=false",
            "distributed.preflight=false", "checkpoint.every_steps=0", *overrides]
    if nproc == 1:
        run([sys.executable, *args], timeout=3600, env=env, log=out / "log.txt")
    else:
        torchrun(args, nproc=nproc, timeout=3600, env=env, log=out / "log.txt")
    records = train_records(out)
    return Result(length, max(r["mem_gb"] for r in records), median([r["step_time_s"] for r in records[1:]]))


def ladder(root: Path, series: str, lengths: list[int], budget: float, steps: int, env: dict) -> list[Result]:
    """The series' runs up to and including its first one over the budget."""
    results = []
    for length in lengths:
        results.append(train(root / series.replace(" ", "_") / str(length), series, length, steps, env))
        print(f"{series}: {length} tokens: peak {results[-1].peak_gib:.2f} GiB per rank, "
              f"step {results[-1].step_s:.2f} s", flush=True)
        if results[-1].peak_gib > budget:
            break
    return results


def longest(results: list[Result], budget: float) -> Result | None:
    fits = [r for r in results if r.peak_gib <= budget]
    return fits[-1] if fits else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="the ladder of row lengths (tokens)")
    p.add_argument("--budget-gib", type=float, default=10.0, help="peak host memory per process that counts as fitting")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--mmap-threshold-mib", type=int, default=1,
                   help="glibc's MALLOC_MMAP_THRESHOLD_ for both series (module docstring); 0: glibc's default")
    p.add_argument("--quick", action="store_true", help="smoke run: 512 and 1024 tokens, 2 steps")
    p.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary directory)")
    args = p.parse_args()
    lengths = [512, 1024] if args.quick else [int(x) for x in args.lengths.split(",")]
    steps = 2 if args.quick else args.steps
    if odd := [n for n in lengths if n % 2]:
        p.error(f"--lengths: {odd} not divisible by sp_size 2")
    root = args.out or Path(tempfile.mkdtemp(prefix="bench_longctx_"))
    load = os.getloadavg()
    env = {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold_mib << 20)} if args.mmap_threshold_mib else {}
    one = ladder(root, "1 process", lengths, args.budget_gib, steps, env)
    l1 = longest(one, args.budget_gib)
    # sp_size 2 from L1 on (L1 itself for the memory ratio), or the whole ladder if one process fits nothing
    sp2 = ladder(root, "sp_size 2", [n for n in lengths if l1 is None or n >= l1.length], args.budget_gib, steps, env)
    l2 = longest(sp2, args.budget_gib)
    load = tuple(max(a, b) for a, b in zip(load, os.getloadavg()))
    print(f"\nllama-32k shape, 1 packed row per step, chunked loss, {steps} steps (step time: median after the "
          f"first), budget {args.budget_gib:g} GiB per process, MALLOC_MMAP_THRESHOLD_ "
          f"{env.get('MALLOC_MMAP_THRESHOLD_', 'default')}; load average (1/5/15 min, the higher of start and "
          "end) " + "/".join(f"{x:.1f}" for x in load) + f" on {os.cpu_count()} cores\n")
    print("| series | row (tokens) | peak host memory / rank | step time |")
    print("| --- | --- | --- | --- |")
    for name, results in (("1 process", one), ("sp_size 2", sp2)):
        for r in results:
            over = " (over the budget)" if r.peak_gib > args.budget_gib else ""
            print(f"| {name} | {r.length} | {r.peak_gib:.2f} GiB{over} | {r.step_s:.2f} s |")
    if l1 is None:
        print(f"\none process fits no length of the ladder within {args.budget_gib:g} GiB: lower --lengths")
        return 1
    at_l1 = next(r for r in sp2 if r.length == l1.length)
    print(f"\nmemory at {l1.length} tokens (the longest one process fits): sp_size 2 / 1 process = "
          f"{at_l1.peak_gib / l1.peak_gib:.2f}x (target <= 0.6x); step time {at_l1.step_s / l1.step_s:.2f}x")
    if l2 is not None:
        ceiling = " (the ladder's end: it may fit more)" if l2 is sp2[-1] else ""
        print(f"longest row within {args.budget_gib:g} GiB per process: {l2.length} vs {l1.length} tokens = "
              f"{l2.length / l1.length:.2f}x (target >= 1.8x){ceiling}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
