"""LoRA vs full fine-tuning, side by side in one run (Llamas of ~100M, ~300M or ~600M parameters).

A 32k vocabulary, 2 ranks, fsdp2, the same shape, data and steps on both sides. Prints training state per rank
(trained parameters + gradients + AdamW moments, from the model), peak host memory per rank (the recipe's
mem_gb: peak RSS, the max over ranks) and the median step time after warm-up, per size.

    python bench/benchmarks/lora/lora.py [--sizes 100M,300M] (or 600M) [--steps 8] [--out DIR]

The base is saved once as a Hugging Face directory, so that every run reads it with the per-rank frugal
loader (a random init would be built whole on rank 0 and inflate its peak)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/: common, benchmarks

from common import RECIPE, REPO, fmt_bytes, median, torchrun, train_records

COMMON_SHAPE = dict(vocab_size=32000, max_position_embeddings=512, tie_word_embeddings=True, num_key_value_heads=4)
SIZES = {  # name: Llama shape (head_dim 64)
    "100M": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12),
    "300M": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16),
    "600M": dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=24),
}
LORA = ["lora.enabled=true", "lora.r=16", "lora.alpha=32", "lora.dropout=0", "lora.target_modules=all-linear",
        "lora.export=adapter"]
RUNS = {  # name: overrides
    "full fine-tuning": [],
    "LoRA r=16": LORA,
    "LoRA r=16, bf16 base (bf16 compute)": [*LORA, "lora.base_dtype=bf16", "parallel.mixed_precision=bf16"],
}
WORLD = 2


def save_base(path: Path, shape: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(REPO / "assets" / "tokenizer")
    config = LlamaConfig(**COMMON_SHAPE, **shape, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def training_state_bytes(base: Path, overrides: list[str]) -> tuple[int, int, int]:
    """(trained parameters, total parameters, fp32 param + grad + 2 AdamW moments of the trained ones per
    rank under fsdp2), from the meta model as the recipe builds it."""
    from llmtrain.models import lora
    from llmtrain.models import hf as model_lib
    from llmtrain.config import load_config

    cfg = load_config(None, [f"model.path={base}", "data.path=x", *overrides])
    model_config = model_lib.load_model_config(cfg.model, model_lib.load_tokenizer(str(base), False))
    model, _ = lora.prepare(model_lib.build_meta_model(model_config, cfg.model), cfg.lora, 0)
    params = {id(p): p for p in model.parameters()}.values()
    trained = sum(p.numel() for p in params if p.requires_grad)
    return trained, sum(p.numel() for p in params), trained * 16 // WORLD


def bench_size(root: Path, shape: dict, steps: int, warmup: int) -> list[tuple]:
    """[(run, trained, total, training state / rank, peak GiB, median step s)] for one shape, RUNS in order."""
    base = root / "base"
    if not (base / "model.safetensors").is_file():
        save_base(base, shape)
    common = [f"model.path={base}", "data.path=data/demo/train.jsonl", "data.seq_len=128", "parallel.strategy=fsdp2",
              "train.micro_batch_size=2", f"train.max_steps={steps}", "train.warmup_steps=0", "log.every_steps=1",
              "log.progress=false", "distributed.preflight=false", "train.lr=1e-4"]
    rows = []
    for name, overrides in RUNS.items():
        out = root / name.split(",")[0].replace(" ", "_").replace("=", "") / ("bf16" if "bf16" in name else "fp32")
        shutil.rmtree(out, ignore_errors=True)
        torchrun([RECIPE, f"output_dir={out}", *common, *overrides], nproc=WORLD, timeout=3600, log=out / "log.txt")
        records = train_records(out)
        trained, total, state = training_state_bytes(base, overrides)
        rows.append((name, trained, total, state, max(r["mem_gb"] for r in records),
                     median([r["step_time_s"] for r in records if r["step"] > warmup])))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="100M,300M",
                   help=f"comma-separated, of {', '.join(SIZES)} (600M: ~8.5 GiB per rank for full fine-tuning)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the step-time median")
    p.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary directory)")
    args = p.parse_args()
    sizes = args.sizes.split(",")
    if unknown := [s for s in sizes if s not in SIZES]:
        p.error(f"--sizes: {unknown} unknown; choose from {', '.join(SIZES)}")
    root = args.out or Path(tempfile.mkdtemp(prefix="bench_lora_"))
    load = os.getloadavg()
    tables = {size: bench_size(root / size, SIZES[size], args.steps, args.warmup) for size in sizes}
    load = tuple(max(a, b) for a, b in zip(load, os.getloadavg()))
    print(f"\n{WORLD} ranks, fsdp2, vocab {COMMON_SHAPE['vocab_size']} (tied), micro-batch 2 x 128 tokens, "
          f"{args.steps} steps, step time = median after {args.warmup}; load average (1/5/15 min, the higher of "
          "start and end) " + "/".join(f"{x:.1f}" for x in load) + f" on {os.cpu_count()} cores\n")
    print("| base (hidden x layers) | run | trained params | training state / rank | vs full | peak host memory "
          "/ rank | vs full | step time | vs full |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for size, rows in tables.items():
        full, shape = rows[0], SIZES[size]
        for name, trained, total, state, mem, step in rows:
            print(f"| {full[2] / 1e6:.0f}M ({shape['hidden_size']} x {shape['num_hidden_layers']}) | {name} | "
                  f"{trained / 1e6:.2f}M ({100 * trained / total:.2f}%) | {fmt_bytes(state)} | {state / full[3]:.1%} | "
                  f"{mem:.2f} GiB | {mem / full[4]:.2f}x | {step:.2f} s | {step / full[5]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
