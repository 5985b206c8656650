"""`memory` (python bench/run.py --only memory): per-rank bytes of parameters + gradients + AdamW state and peak RSS for
ddp / fsdp / fsdp2 on an ~81M-parameter Llama (bench/benchmarks/memory/probe.py), and the host RAM used while loading it
from a safetensors directory with 2 ranks vs one copy of the weights. Targets: fsdp* training state <= 0.6x ddp; loading
<= 1.3x one copy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.base import Ctx, MEM_SHAPE, MEM_SHAPE_QUICK, TIMEOUT, ratio, table
from common import fmt_bytes, run, torchrun

MEMORY_PROBE = Path(__file__).parent / "probe.py"  # also the model exporter of other benchmarks (--export)


def bench(ctx: Ctx) -> dict:
    work = ctx.dir("memory")
    shape = MEM_SHAPE_QUICK if ctx.quick else MEM_SHAPE
    model_dir = work / "model"
    out, _ = run([sys.executable, MEMORY_PROBE, "--export", model_dir, "--shape", json.dumps(shape)],
                 timeout=TIMEOUT)
    exported = json.loads(out.strip().splitlines()[-1])
    weights = exported["bytes"]
    per = {}
    for strategy in ("ddp", "fsdp", "fsdp2"):
        res = work / f"{strategy}.json"
        torchrun([MEMORY_PROBE, "--model", model_dir, "--strategy", strategy, "--out", res],
                 timeout=TIMEOUT, log=work / f"{strategy}.log")
        per[strategy] = json.loads(res.read_text())["ranks"]
    state = {s: max(r["params_bytes"] + r["grads_bytes"] + r["optim_bytes"] for r in ranks) for s, ranks in per.items()}
    rows = []
    for s, ranks in per.items():
        r0 = ranks[0]
        rows.append([s, fmt_bytes(r0["params_bytes"]), fmt_bytes(r0["grads_bytes"]), fmt_bytes(r0["optim_bytes"]),
                     fmt_bytes(state[s]), f"{state[s] / state['ddp']:.2f}",
                     " / ".join(fmt_bytes(r["peak_rss_bytes"]) for r in ranks),
                     f"{max(r['peak_rss_bytes'] for r in ranks) / max(r['peak_rss_bytes'] for r in per['ddp']):.2f}"])
    text = table(["strategy", "params / rank", "grads / rank", "AdamW state / rank", "training state / rank",
                  "vs ddp", "peak RSS rank 0 / rank 1", "peak RSS vs ddp"], rows)
    n = per["ddp"][0]["n_params"]
    text += (f"\n\n{n / 1e6:.1f}M-parameter Llama ({shape['hidden_size']} hidden, {shape['num_hidden_layers']} layers, "
             f"vocab {shape['vocab_size']}, tied embeddings), fp32, 2 ranks on CPU, loaded from a safetensors "
             "directory, one AdamW step (micro-batch 1 x 128 tokens). Bytes are sums of this rank's local "
             "tensors (FSDP2: DTensor local shards; FSDP1: flat parameters). Peak RSS (getrusage) includes "
             "the ~0.35 GiB of imports, the loading peak, activations, all-gather buffers and allocator slack.")
    load_rows, load_ratios = [], []
    for s, ranks in per.items():
        total = sum(r["load_peak_bytes"] for r in ranks)
        anon = sum(r["load_anon_peak_bytes"] for r in ranks)
        shards = sum(r["params_bytes_after_load"] for r in ranks)
        load_rows.append([s, " / ".join(fmt_bytes(r["load_peak_bytes"]) for r in ranks), f"{total / weights:.2f}",
                          f"{anon / weights:.2f}", fmt_bytes(shards), f"{(anon - shards) / weights:.2f}"])
        if s in ("fsdp", "fsdp2"):  # ddp keeps a full replica per rank by design: 2 copies at least
            load_ratios += [ratio(f"memory: loading {s}, private host RAM incl. shards / one copy", anon / weights,
                                  1.3, "<=", "RssAnon peak increase summed over both ranks; on CPU the shards "
                                  "live in host RAM"),
                            ratio(f"memory: loading {s}, private host RAM beyond shards / one copy",
                                  (anon - shards) / weights, 1.3, "<=",
                                  "what a GPU run would hold in host RAM (its shards are on the GPUs)")]
    text += "\n\nLoading (" + fmt_bytes(weights) + " of safetensors weights = one copy):\n\n" + table(
        ["strategy", "VmHWM increase rank 0 / rank 1", "VmHWM sum / one copy", "RssAnon sum / one copy",
         "loaded params, both ranks", "(RssAnon sum - loaded params) / one copy"], load_rows)
    text += ("\n\nVmHWM is reset just before parallelize + load_weights and read after; the increase is over the "
             "RSS just before. It counts the safetensors file pages each rank maps to read its weights: page cache, "
             "shared by the ranks and reclaimable, so the sum counts it once per rank. RssAnon (sampled every "
             "2 ms) is the private memory and the figure the targets use. On CPU the loaded parameters "
             "themselves live in host RAM (one copy over both ranks with fsdp/fsdp2, one per rank with ddp).")
    return {"title": "Memory per rank (ddp / fsdp / fsdp2)", "table": text,
            "ratios": [ratio("memory: fsdp training state / ddp", state["fsdp"] / state["ddp"], 0.6, "<="),
                       ratio("memory: fsdp2 training state / ddp", state["fsdp2"] / state["ddp"], 0.6, "<="),
                       *load_ratios],
            "raw": {"per_rank": per, "weights_bytes": weights, "n_params": n, "shape": shape}}
