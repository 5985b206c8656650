"""LoRA vs full fine-tuning, side by side in one run: a ~100M-parameter Llama with a 32k vocabulary,
2 ranks, fsdp2, the same shape, data and steps. Prints training state per rank (trained parameters +
gradients + AdamW moments, from the model), peak host memory per rank (the recipe's mem_gb: peak RSS,
the max over ranks) and the median step time after warm-up.

    python bench/lora.py [--steps 8] [--out DIR]

The base is saved once as a Hugging Face directory, so that every run reads it with the per-rank frugal
loader (a random init would be built whole on rank 0 and inflate its peak)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RECIPE, REPO, fmt_bytes, median, torchrun, train_records  # noqa: E402

SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=512, tie_word_embeddings=True)
LORA = ["lora.enabled=true", "lora.r=16", "lora.alpha=32", "lora.dropout=0", "lora.target_modules=all-linear",
        "lora.export=adapter"]
RUNS = {  # name: overrides
    "full fine-tuning": [],
    "LoRA r=16": LORA,
    "LoRA r=16, bf16 base (bf16 compute)": [*LORA, "lora.base_dtype=bf16", "parallel.mixed_precision=bf16"],
}
WORLD = 2


def save_base(path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(REPO / "assets" / "tokenizer")
    config = LlamaConfig(**SHAPE, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def training_state_bytes(base: Path, overrides: list[str]) -> tuple[int, int, int]:
    """(trained parameters, total parameters, fp32 param + grad + 2 AdamW moments of the trained ones per
    rank under fsdp2), from the meta model as the recipe builds it."""
    from llmtrain import lora, model as model_lib
    from llmtrain.config import load_config

    cfg = load_config(None, [f"model.path={base}", "data.path=x", *overrides])
    model_config = model_lib.load_model_config(cfg.model, model_lib.load_tokenizer(str(base), False))
    model, _ = lora.prepare(model_lib.build_meta_model(model_config, cfg.model), cfg.lora, 0)
    params = {id(p): p for p in model.parameters()}.values()
    trained = sum(p.numel() for p in params if p.requires_grad)
    return trained, sum(p.numel() for p in params), trained * 16 // WORLD


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the step-time median")
    p.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary directory)")
    args = p.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="bench_lora_"))
    base = root / "base"
    if not (base / "model.safetensors").is_file():
        save_base(base)
    common = [f"model.path={base}", "data.path=data/demo/train.jsonl", "data.seq_len=128", "parallel.strategy=fsdp2",
              "train.micro_batch_size=2", f"train.max_steps={args.steps}", "train.warmup_steps=0", "log.every_steps=1",
              "log.progress=false", "distributed.preflight=false", "train.lr=1e-4"]
    rows = []
    load = os.getloadavg()
    for name, overrides in RUNS.items():
        out = root / name.split(",")[0].replace(" ", "_").replace("=", "") / ("bf16" if "bf16" in name else "fp32")
        shutil.rmtree(out, ignore_errors=True)
        torchrun([RECIPE, f"output_dir={out}", *common, *overrides], nproc=WORLD, timeout=1800, log=out / "log.txt")
        records = train_records(out)
        trained, total, state = training_state_bytes(base, overrides)
        rows.append((name, trained, total, state, max(r["mem_gb"] for r in records),
                     median([r["step_time_s"] for r in records if r["step"] > args.warmup])))
    load = tuple(max(a, b) for a, b in zip(load, os.getloadavg()))
    full = rows[0]
    print(f"\n{WORLD} ranks, fsdp2, {full[2] / 1e6:.0f}M parameters (vocab {SHAPE['vocab_size']}), micro-batch 2 x 128 "
          f"tokens, {args.steps} steps; load average (1/5/15 min, the higher of start and end) "
          + "/".join(f"{x:.1f}" for x in load) + f" on {os.cpu_count()} cores\n")
    print("| run | trained params | training state / rank | vs full | peak host memory / rank | vs full "
          "| step time | vs full |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, trained, total, state, mem, step in rows:
        print(f"| {name} | {trained / 1e6:.2f}M ({100 * trained / total:.2f}%) | {fmt_bytes(state)} | "
              f"{state / full[3]:.1%} | {mem:.2f} GiB | {mem / full[4]:.2f}x | {step:.2f} s | {step / full[5]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
