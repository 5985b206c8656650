"""GRPO's rollout engines side by side on bench/gpu.sh's model, with transformers' generate as the baseline: the
generated tokens/s of one generation batch per engine, and the ratio the vLLM engine's target is stated in
(generation >= 5x HF generate on one H100/H200-class GPU, the same model and rows).

    python bench/gpu/engines.py [--out DIR]            # on the GPU machine (bench/gpu.sh runs it)
    python bench/gpu/engines.py --cpu-smoke            # a tiny model on CPU: the code paths; timings mean nothing

STATUS: NOT RUN ON A GPU YET (written on a CPU-only machine; --cpu-smoke ran there, vllm skipped).

Model: bench/gpu/gpu-1b.yaml's model.config (a ~1.2B Llama, random init) in bf16 on the GPU; rows: the first
--prompts prompts of data/demo/prompts.jsonl (the bundled tokenizer) x --generations, completions of --length
tokens (random weights rarely sample an EOS: nearly every completion runs the whole length), temperature 1, no
top-k / top-p. A 1-rank process group (NCCL; gloo on CPU), as a 1-GPU training run has. Rows, in order:
  hf            model.generate(do_sample=True, top_k=0) on the left-padded batch: the baseline
  local         llmtrain.rollout.registry.ENGINES["local"] on the model itself (the keyed sampler, KV cache)
  transformers  ENGINES["transformers"]: continuous batching on its own fp32 copy
  vllm          ENGINES["vllm"]: vLLM colocated in this process (needs `pip install vllm`; skipped with the
                set-up check's line when it is not importable or on CPU)
Each engine is built from a rollout: section (RolloutSection, checked by llmtrain.rollout.section.check_engine) and
gets the model's weights as recipes/grpo.py pushes them (llmtrain.rollout.sync.WeightSync: export.hf_state, then
update_weights and the fingerprint check), one short warm-up call, then --repeats timed calls (median). Columns:
generated tokens/s, its ratio to hf, seconds to build and push, mean |engine - model| log-prob of the sampled
tokens (the drift guard's difference; the model's from one forward per row), mean completion length.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import yaml  # noqa: E402

from llmtrain.config import ConfigError  # noqa: E402
from llmtrain.export import hf_state  # noqa: E402
from llmtrain.parallelize import STRATEGIES  # noqa: E402
from llmtrain.rollout.engine import EngineSetup, Sampling  # noqa: E402
from llmtrain.rollout.registry import ENGINES  # noqa: E402
from llmtrain.rollout.section import RolloutSection, check_engine  # noqa: E402
from llmtrain.rollout.sync import WeightSync  # noqa: E402

SEED, TARGET = 42, 5.0
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=1024)  # bench/gpu.sh --cpu-smoke's


def process_group(device: torch.device) -> None:
    """A 1-rank group, with the variables torchrun would set (vLLM's external_launcher reads RANK, LOCAL_RANK)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(port))):
        os.environ.setdefault(key, value)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)


def model_logps(model, prompts: list[list[int]], tokens: list[list[int]], device: torch.device) -> list[list[float]]:
    """The model's log-probs (temperature 1, unfiltered) of each row's sampled tokens, one forward per row."""
    out = []
    with torch.no_grad():
        for p, t in zip(prompts, tokens):
            logits = model(torch.tensor([p + t], device=device)).logits[0, len(p) - 1:-1].float()
            out.append(logits.log_softmax(-1).gather(1, torch.tensor(t, device=device)[:, None])[:, 0].tolist())
    return out


def engine_setup(model, eos: list[int], pad: int, device: torch.device, rows: list[list[int]], max_tokens: int,
                 dtype: torch.dtype, workdir: str) -> EngineSetup:
    """The EngineSetup llmtrain.rollout.registry.build makes in a run, for `model` outside one: no autocast (the
    model is already in `dtype`), room for the longest row plus max_tokens, all rows in one call."""
    return EngineSetup(model, model.config, contextlib.nullcontext, eos, pad, device, max(map(len, rows)) + max_tokens,
                       len(rows), SEED, dtype, workdir)


def pushed_engine(section: RolloutSection, setup: EngineSetup):
    """ENGINES[section.engine] with the model's weights pushed as recipes/grpo.py pushes them (WeightSync.push:
    export.hf_state, then update_weights and the fingerprint check)."""
    engine = ENGINES[section.engine](section, setup)
    WeightSync(engine, section.engine, SEED, lambda: hf_state(setup.model, STRATEGIES["none"], setup.device)).push(0)
    return engine


def hf_generate(model, prompts, sampling: Sampling, eos: list[int], pad: int, device) -> tuple[list, list, float]:
    """transformers' generate on the left-padded batch: (tokens up to the first EOS, log-probs (none), seconds)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                         max_new_tokens=sampling.max_tokens, eos_token_id=eos, pad_token_id=pad)[:, width:].tolist()
    seconds = time.perf_counter() - t0
    return [row[:next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in out], None, seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=2, help="prompts (the demo's first)")
    p.add_argument("--generations", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--length", type=int, default=128, help="tokens per completion at most")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engines", nargs="+", default=["hf", "local", "transformers", "vllm"])
    p.add_argument("--vllm-memory", type=float, default=0.5, help="rollout.vllm_gpu_memory_utilization")
    p.add_argument("--out", default="outputs/bench-gpu/engines", help="results.json and vLLM's scratch files")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU, 16 tokens, 1 repeat")
    args = p.parse_args()
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        print("no CUDA device visible (use --cpu-smoke for a dry run)")
        return 1
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    shape = yaml.safe_load((REPO / "bench" / "gpu" / "gpu-1b.yaml").read_text())["model"]["config"]
    if args.cpu_smoke:
        shape.update(SMOKE_SHAPE)
        args.length, args.repeats = 16, 1
    dtype = torch.bfloat16 if cuda else torch.float32
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    process_group(device)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(device, dtype).eval()
    tok = AutoTokenizer.from_pretrained(REPO / "assets" / "tokenizer")
    eos, pad = [tok.eos_token_id], tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    lines = (REPO / "data" / "demo" / "prompts.jsonl").read_text().splitlines()[:args.prompts]
    prompts = [tok(json.loads(line)["prompt"])["input_ids"] for line in lines]
    rows = [q for q in prompts for _ in range(args.generations)]
    keys = [(SEED, 0, i // args.generations, i % args.generations) for i in range(len(rows))]
    setup = engine_setup(model, eos, pad, device, rows, args.length, dtype, str(out_dir))
    print(f"model: {sum(x.numel() for x in model.parameters()) / 1e9:.2f}B parameters, {dtype}, {device}; "
          f"{len(rows)} rows ({args.prompts} prompts x G {args.generations}), {args.length} tokens at most, "
          f"{args.repeats} timed call(s) each", flush=True)
    results = {}
    for name in args.engines:
        t0 = time.perf_counter()
        try:
            if name == "hf":
                call = lambda n: hf_generate(model, rows, Sampling(n), eos, pad, device)  # noqa: E731
            else:
                section = RolloutSection(engine=name, vllm_gpu_memory_utilization=args.vllm_memory)
                check_engine(section, cuda)
                engine = pushed_engine(section, setup)

                def call(n, engine=engine):
                    done = engine.generate(rows, keys, Sampling(n))
                    return done.tokens, done.logps, done.seconds
            built = time.perf_counter() - t0
            call(4)  # warm-up
            runs = [call(args.length) for _ in range(args.repeats)]
        except ConfigError as e:
            print(f"-- {name}: skipped: {e}", flush=True)
            continue
        except Exception as e:  # one engine failing leaves the others' rows
            print(f"-- {name}: FAILED: {type(e).__name__}: {str(e).strip()[:400]}", flush=True)
            continue
        tokens, logps, _ = runs[0]
        seconds = sorted(r[2] for r in runs)[len(runs) // 2]
        generated = sum(map(len, tokens))
        drift = None
        if logps is not None:
            ref = model_logps(model, rows, tokens, device)
            diffs = [abs(a - b) for e, r in zip(logps, ref) for a, b in zip(e, r)]
            drift = sum(diffs) / max(len(diffs), 1)
        results[name] = {"tokens_per_s": generated / seconds, "seconds": seconds, "build_s": built,
                         "mean_length": generated / len(rows), "logprob_diff_mean": drift}
        print(f"-- {name}: {generated} tokens in {seconds:.2f} s (built and pushed in {built:.1f} s)", flush=True)
        engine = call = runs = None  # freed before the next engine takes its memory
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    base = results.get("hf", {}).get("tokens_per_s")
    print("\n| engine | generated tokens/s | vs hf generate | build + push s | mean length | "
          "mean abs log-prob diff |\n|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "n/a"
        diff = "n/a" if r["logprob_diff_mean"] is None else f"{r['logprob_diff_mean']:.2e}"
        print(f"| {name} | {r['tokens_per_s']:,.0f} | {ratio} | {r['build_s']:.1f} | {r['mean_length']:.0f} | "
              f"{diff} |")
    if base and "vllm" in results:
        ratio = results["vllm"]["tokens_per_s"] / base
        print(f"\nvllm / hf generate: {ratio:.2f}x generated tokens/s (target >= {TARGET:g}x on one H100/H200-class "
              f"GPU): {'met' if ratio >= TARGET else 'NOT met'}")
    else:
        print("\nvllm / hf generate: not measured (a row is missing above)")
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
