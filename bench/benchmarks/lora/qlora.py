"""QLoRA (NF4 base) vs LoRA on a bf16 base, side by side in one run: base bytes, peak host memory, step time.

The 634M Llama of bench/benchmarks/lora/lora.py (hidden 1536 x 24 layers, vocab 32k, tied), 2 ranks, fsdp2, bf16 compute
(parallel.mixed_precision=bf16, lora.base_dtype=bf16) on both sides, LoRA r=16 on all linears, the same data
and steps. Prints, per rank: the frozen base's bytes (from the run's own nf4 start-up line), the recipe's peak
host memory (mem_gb: peak RSS, the max over ranks), the median step time after warm-up; then where QLoRA's
extra time goes, measured on this machine's one thread per rank: dequantizing every block linear (torchao
dequantizes a weight in the forward and again for the input gradient), the rest being LoRA's own step.

The recipe's peak (getrusage's ru_maxrss) counts the safetensors file's pages mapped while loading (each rank
touches ~1.2 GB of them at 634M) and whatever glibc keeps of freed blocks; so each side is also probed on its
own (`_probe`, the same build_model and overrides, forward + backward of micro x seq tokens): the peak of its
anonymous memory (RssAnon, sampled every 2 ms) while building and while training, run with glibc returning
freed blocks >= 64 KiB to the system (MALLOC_MMAP_THRESHOLD_), so that the peak is what is live.

    python bench/benchmarks/lora/qlora.py [--size 600M] [--steps 5] [--warmup 2] [--out DIR]
    python bench/benchmarks/lora/qlora.py --estimate     # the fit table of docs/lora.md (no training; a few seconds)

--estimate measures bytes per parameter (an NF4Tensor's storage, torchao's to_nf4 at block 64 / scaler 256)
and one decoder layer's saved activations per token (autograd's saved-tensor hooks on a meta-device layer
with r=16 adapters, bf16: no memory, no compute), then adds them up for Llama-3.1 8B and 70B shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/: common, benchmarks

from common import RECIPE, fmt_bytes, median, torchrun, train_records
from benchmarks.lora.lora import COMMON_SHAPE, LORA, SIZES, WORLD, save_base
from benchmarks.memory.probe import AnonPeak

BF16 = [*LORA, "lora.base_dtype=bf16", "parallel.mixed_precision=bf16"]
RUNS = {"LoRA r=16, bf16 base": BF16, "QLoRA r=16, nf4 base": [*BF16, "lora.quantize_base=nf4"]}
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


# name: (Llama shape, parameters outside the block linears: embeddings + output layer + norms)
FIT_SHAPES = {"8B": (dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8), 1.05e9),
              "70B": (dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                           num_key_value_heads=8), 2.10e9)}
CARDS_GB = (24, 48, 80)
ROW_TOKENS = 4096
OVERHEAD = 3e9  # per card: CUDA context, allocator slack, one logits chunk (train.loss_impl=chunked), comms buffers


def nf4_bytes_per_param() -> float:
    import torch

    from llmtrain.models import nf4

    w = torch.randn(4096, 4096, dtype=torch.bfloat16)
    return nf4.nbytes(nf4._torchao().to_nf4(w, 64, 256)) / w.numel()


def layer_activation_bytes(shape: dict) -> tuple[float, int]:
    """(bytes autograd saves per token in one bf16 decoder layer with r=16 adapters on a frozen base, without
    checkpointing; the layer's block linear parameters). Measured at two lengths on the meta device (lengths no
    weight dimension equals, so that the frozen weights autograd keeps for the input gradient are told apart and
    left out) and fitted a + b * tokens: b is the math attention's score matrix (a flash kernel saves none), a is
    reported. An upper bound: an input read by several adapters (q, k, v) is counted once per reader."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(**shape)
    config._attn_implementation = "sdpa"
    head = shape["hidden_size"] // shape["num_attention_heads"]
    per_token = []
    with torch.device("meta"):
        layer = LlamaDecoderLayer(config, 0).to(torch.bfloat16).requires_grad_(False)
        linears = sum(p.numel() for p in layer.parameters() if p.dim() == 2)
        layer = inject_adapter_in_model(LoraConfig(r=16, target_modules="all-linear"), layer)
        for tokens in (1000, 1500):
            x = torch.randn(1, tokens, shape["hidden_size"], dtype=torch.bfloat16, requires_grad=True)
            rope = torch.randn(1, tokens, head, dtype=torch.bfloat16)
            saved = []
            def pack(t, tokens=tokens, saved=saved):
                saved.append(t.nbytes if tokens in t.shape else 0)
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                layer(x, position_embeddings=(rope, rope), attention_mask=None)
            per_token.append(sum(saved) / tokens)
    slope = (per_token[1] - per_token[0]) / 500
    return per_token[0] - slope * 1000, linears


def estimate() -> None:
    nf4_b = nf4_bytes_per_param()
    print(f"bytes per parameter: NF4 base {nf4_b:.4f} (measured), bf16 base 2, full fine-tuning 16 (fp32 weight, "
          f"gradient, 2 AdamW moments), adapters 16\n")
    print(f"| model | run | weights + trained state | activations per {ROW_TOKENS}-token row (checkpointed) | "
          + " | ".join(f"{gb} GB cards" for gb in CARDS_GB) + " |")
    print("| --- | --- | --- | --- | " + " | ".join("---" for _ in CARDS_GB) + " |")
    for name, (shape, other) in FIT_SHAPES.items():
        per_layer, linears = layer_activation_bytes(shape)
        layers, hidden = shape["num_hidden_layers"], shape["hidden_size"]
        adapters = layers * 16 * sum(i + o for i, o in _linear_dims(shape))
        blocks = layers * linears
        # checkpointing keeps each layer's input (bf16) and recomputes one layer at a time
        acts = ROW_TOKENS * (layers * 2 * hidden + per_layer)
        # (run, sharded weights + trained state, one gathered layer: QLoRA's in NF4, full's with fp32 gradients)
        for run, sharded, gathered in (("QLoRA", blocks * nf4_b + other * 2 + adapters * 16, linears * nf4_b),
                                       ("LoRA (bf16 base)", (blocks + other) * 2 + adapters * 16, linears * 2),
                                       ("full", (blocks + other) * 16, linears * 6)):
            cards = []
            for gb in CARDS_GB:
                room = gb * 1e9 - OVERHEAD - acts - gathered
                cards.append(f"{max(1, -(-sharded // room)):.0f}" if room > 0 else "-")
            print(f"| {name} | {run} | {sharded / 1e9:.1f} GB | {acts / 1e9:.2f} GB | " + " | ".join(cards) + " |")
    print(f"\ncards: the fewest that hold it with fsdp2 (weights and state sharded, one gathered layer, "
          f"{OVERHEAD / 1e9:.0f} GB fixed per card), micro-batch 1 x {ROW_TOKENS} tokens, activation checkpointing, "
          f"bf16 compute; one recomputed layer saves {per_layer:.0f} bytes per token "
          f"({per_layer / hidden:.0f} x hidden, "
          "the last model's)")


def _linear_dims(shape: dict) -> list[tuple[int, int]]:
    """(in, out) of q k v o gate up down."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    return [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]


LIVE = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}  # glibc: freed blocks go back


def probe(overrides: list[str], steps: int, micro: int, seq: int, out: Path) -> None:
    """One rank of the memory probe (under torchrun): build as the recipe does, then `steps` forward + backward
    passes; rank 0 writes the peaks of anonymous memory (max over ranks) to `out`."""
    import torch
    import torch.distributed as dist

    from llmtrain import distributed
    from llmtrain.config import load_config
    from llmtrain.models import hf as model_lib
    from llmtrain.models.build import build_model

    cfg = load_config(None, ["data.path=x", *overrides])
    env = distributed.init(cfg.distributed)
    model_config = model_lib.load_model_config(cfg.model, model_lib.load_tokenizer(cfg.model.path, False))
    with AnonPeak() as building:
        model = build_model(cfg.model, model_config, cfg.parallel, env, cfg.train.seed, cfg.lora).model
    torch.manual_seed(0)
    ids = torch.randint(0, model_config.vocab_size, (micro, seq))
    with AnonPeak() as training:
        for _ in range(steps):
            model(input_ids=ids, labels=ids).loss.backward()
    peaks = torch.tensor([building.peak, training.peak], dtype=torch.float64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    if env.rank == 0:
        out.write_text(json.dumps({"build": peaks[0].item(), "train": peaks[1].item()}))
    distributed.shutdown()


def main() -> int:
    if sys.argv[1:2] == ["_probe"]:
        steps, micro, seq, out, *overrides = sys.argv[2:]
        probe(overrides, int(steps), int(micro), int(seq), Path(out))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="600M", choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the step-time median")
    p.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary directory)")
    p.add_argument("--micro", type=int, default=2, help="rows per micro-batch")
    p.add_argument("--seq", type=int, default=128, help="tokens per row")
    p.add_argument("--estimate", action="store_true", help="print the fit table only")
    args = p.parse_args()
    if args.estimate:
        estimate()
        return 0
    root = args.out or Path(tempfile.mkdtemp(prefix="bench_qlora_"))
    shape, base = SIZES[args.size], root / "base"
    if not (base / "model.safetensors").is_file():
        save_base(base, shape)
    common = [f"model.path={base}", "data.path=data/demo/train.jsonl", f"data.seq_len={args.seq}",
              "parallel.strategy=fsdp2", f"train.micro_batch_size={args.micro}", f"train.max_steps={args.steps}",
              "train.warmup_steps=0", "log.every_steps=1", "log.progress=false", "distributed.preflight=false",
              "train.lr=1e-4"]
    load = os.getloadavg()
    rows, probes = {}, {}
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
        torchrun([Path(__file__), "_probe", 2, args.micro, args.seq, out / "probe.json", *common, *overrides],
                 nproc=WORLD, timeout=3600, env=LIVE, log=out / "probe.txt")
        probes[name] = json.loads((out / "probe.json").read_text())
    load = tuple(max(a, b) for a, b in zip(load, os.getloadavg()))
    (lora_base, lora_peak, lora_step), (q_base, q_peak, q_step) = rows.values()
    print(f"\n{args.size} ({shape['hidden_size']} x {shape['num_hidden_layers']}), vocab {COMMON_SHAPE['vocab_size']}, "
          f"{WORLD} ranks, fsdp2, bf16 compute, micro-batch {args.micro} x {args.seq} tokens, {args.steps} steps, "
          f"step time = median after {args.warmup}; load average (1/5/15 min, the higher of start and end) "
          + "/".join(f"{x:.1f}" for x in load) + f" on {os.cpu_count()} cores\n")
    print("| run | base weights / rank | vs LoRA | peak host memory / rank | vs LoRA | step time | vs LoRA |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, (b, peak, step) in rows.items():
        print(f"| {name} | {fmt_bytes(b)} | {b / lora_base:.3f}x | {fmt_bytes(peak)} | {peak / lora_peak:.2f}x | "
              f"{step:.2f} s | {step / lora_step:.2f}x |")
    saved = lora_base - q_base
    print(f"\nrecipe: peak(LoRA) - peak(QLoRA) = {fmt_bytes(lora_peak - q_peak)} per rank vs 0.8 x (bf16 base - NF4 "
          f"base) = {fmt_bytes(0.8 * saved)} ({(lora_peak - q_peak) / saved:.2f}x the bytes saved)\n")
    print("| probe (anonymous memory, freed blocks returned) | peak building / rank | vs LoRA | peak in 2 forward + "
          "backward / rank | vs LoRA |")
    print("| --- | --- | --- | --- | --- |")
    lora_probe, q_probe = probes.values()
    for name, peaks in probes.items():
        print(f"| {name} | {fmt_bytes(peaks['build'])} | {peaks['build'] / lora_probe['build']:.2f}x | "
              f"{fmt_bytes(peaks['train'])} | {peaks['train'] / lora_probe['train']:.2f}x |")
    drop = lora_probe["train"] - q_probe["train"]
    print(f"\nprobe: peak(LoRA) - peak(QLoRA) in training = {fmt_bytes(drop)} per rank ({drop / saved:.2f}x the "
          f"{fmt_bytes(saved)} the base saved; goal >= 0.8x)")
    dequant = dequant_seconds(shape)
    extra = q_step - lora_step
    print(f"\nQLoRA's step is {extra:.2f} s longer; dequantizing the {shape['num_hidden_layers']} layers' block "
          f"linears twice (forward, input gradient), timed alone on one thread, takes {dequant:.2f} s per rank "
          f"({dequant / max(extra, 1e-9):.0%} of that difference); the matmuls and the rest are LoRA's "
          f"{lora_step:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
