"""QLoRA (NF4 base) vs LoRA on a bf16 base, side by side in one run: base bytes, peak host memory, step time.

The 634M Llama of bench/lora.py (hidden 1536 x 24 layers, vocab 32k, tied), 2 ranks, fsdp2, bf16 compute
(parallel.mixed_precision=bf16, lora.base_dtype=bf16) on both sides, LoRA r=16 on all linears, the same data
and steps. Prints, per rank: the frozen base's bytes (from the run's own nf4 start-up line), the recipe's peak
host memory (mem_gb: peak RSS, the max over ranks), the median step time after warm-up; then where QLoRA's
extra time goes, measured on this machine's one thread per rank: dequantizing every block linear (torchao
dequantizes a weight in the forward and again for the input gradient), the rest being LoRA's own step.

    python bench/qlora.py [--size 600M] [--steps 5] [--warmup 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RECIPE, fmt_bytes, median, torchrun, train_records
from lora import COMMON_SHAPE, LORA, SIZES, WORLD, save_base

BF16 = [*LORA, "lora.base_dtype=bf16", "parallel.mixed_precision=bf16"]
RUNS = {"LoRA r=16, bf16 base": BF16, "QLoRA r=16, nf4 base": [*BF16, "lora.quantize_base=nf4"]}
MICRO, SEQ = 2, 128
NF4_LINE = re.compile(r"nf4: \d+ block linear weights \(\S+M parameters\) at (\S+) MiB per rank with scales vs "
                      r"(\S+) MiB in bf16")


def frozen_bytes_per_rank(base: Path, overrides: list[str]) -> int:
    """The frozen base in bf16 per rank under fsdp2 (every frozen parameter sharded over WORLD)."""
    from llmtrain.config import load_config
    from llmtrain.models import hf as model_lib
    from llmtrain.models import lora

    cfg = load_config(None, [f"model.path={base}", "data.path=x", *overrides])
    model_config = model_lib.load_model_config(cfg.model, model_lib.load_tokenizer(str(base), False))
    model, _ = lora.prepare(model_lib.build_meta_model(model_config, cfg.model), cfg.lora, 0)
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in params if not p.requires_grad) * 2 // WORLD


def dequant_seconds(shape: dict, repeat: int = 3) -> float:
    """Seconds per step per rank spent dequantizing, one thread: under fsdp2 each rank gathers every block
    linear whole and torchao dequantizes it twice (forward, input gradient) in lora.base_dtype (bf16)."""
    import torch
    from torchao.quantization import to_nf4

    torch.set_num_threads(1)
    h, i, kv = shape["hidden_size"], shape["intermediate_size"], COMMON_SHAPE["num_key_value_heads"] * 64
    total = 0.0
    for out_f, in_f in [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]:  # q k v o gate up down
        q = to_nf4(torch.randn(out_f, in_f, dtype=torch.bfloat16) * 0.02, 64, 256)
        q.get_original_weight()  # warm-up
        t0 = time.perf_counter()
        for _ in range(repeat):
            q.get_original_weight()
        total += 2 * (time.perf_counter() - t0) / repeat
    return total * shape["num_hidden_layers"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="600M", choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the step-time median")
    p.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary directory)")
    args = p.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="bench_qlora_"))
    shape, base = SIZES[args.size], root / "base"
    if not (base / "model.safetensors").is_file():
        save_base(base, shape)
    common = [f"model.path={base}", "data.path=data/demo/train.jsonl", f"data.seq_len={SEQ}",
              "parallel.strategy=fsdp2", f"train.micro_batch_size={MICRO}", f"train.max_steps={args.steps}",
              "train.warmup_steps=0", "log.every_steps=1", "log.progress=false", "distributed.preflight=false",
              "train.lr=1e-4"]
    load = os.getloadavg()
    rows = {}
    for name, overrides in RUNS.items():
        out = root / ("qlora" if "nf4" in name else "lora")
        shutil.rmtree(out, ignore_errors=True)
        log, _ = torchrun([RECIPE, f"output_dir={out}", *common, *overrides], nproc=WORLD, timeout=3600,
                          log=out / "log.txt")
        records = train_records(out)
        base_bytes = frozen_bytes_per_rank(base, overrides)
        if m := NF4_LINE.search(log):  # the quantized weights: NF4 + scales in place of their bf16 bytes
            base_bytes += round((float(m.group(1)) - float(m.group(2))) * 2**20)
        rows[name] = (base_bytes, max(r["mem_gb"] for r in records) * 2**30,
                      median([r["step_time_s"] for r in records if r["step"] > args.warmup]))
    load = tuple(max(a, b) for a, b in zip(load, os.getloadavg()))
    (lora_base, lora_peak, lora_step), (q_base, q_peak, q_step) = rows.values()
    print(f"\n{args.size} ({shape['hidden_size']} x {shape['num_hidden_layers']}), vocab {COMMON_SHAPE['vocab_size']}, "
          f"{WORLD} ranks, fsdp2, bf16 compute, micro-batch {MICRO} x {SEQ} tokens, {args.steps} steps, step time = "
          f"median after {args.warmup}; load average (1/5/15 min, the higher of start and end) "
          + "/".join(f"{x:.1f}" for x in load) + f" on {os.cpu_count()} cores\n")
    print("| run | base weights / rank | vs LoRA | peak host memory / rank | vs LoRA | step time | vs LoRA |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, (b, peak, step) in rows.items():
        print(f"| {name} | {fmt_bytes(b)} | {b / lora_base:.3f}x | {fmt_bytes(peak)} | {peak / lora_peak:.2f}x | "
              f"{step:.2f} s | {step / lora_step:.2f}x |")
    saved = lora_base - q_base
    print(f"\npeak(LoRA) - peak(QLoRA) = {fmt_bytes(lora_peak - q_peak)} per rank vs 0.8 x (bf16 base - NF4 base) "
          f"= {fmt_bytes(0.8 * saved)} ({(lora_peak - q_peak) / saved:.2f}x the bytes saved)")
    dequant = dequant_seconds(shape)
    extra = q_step - lora_step
    print(f"\nwhere QLoRA's extra {extra:.2f} s per step goes: dequantizing the {shape['num_hidden_layers']} layers' "
          f"block linears twice (forward, input gradient) takes {dequant:.2f} s per rank on one thread here "
          f"({dequant / max(extra, 1e-9):.0%} of it); the matmuls and the rest are LoRA's {lora_step:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
