"""`dpo_reference` (python bench/run.py --only dpo_reference): recipes/dpo.py's peak host memory per rank with
dpo.precompute_reference vs the live frozen reference: full fine-tuning, fsdp2, 2 ranks, ~53M parameters
(bench/benchmarks/dpo_reference/dpo_memory.py). Target <= 0.7x. --quick makes every benchmark tiny (a smoke run: the
figures mean little). The GPU benchmark is a separate script, bench/gpu.sh (see its header)."""

from __future__ import annotations

from benchmarks.base import Ctx, ratio


def bench(ctx: Ctx) -> dict:
    from benchmarks.dpo_reference import dpo_memory

    res = dpo_memory.measure(ctx.dir("dpo_reference"), quick=ctx.quick)
    return {"title": "DPO: precomputed reference log-probs vs the live frozen reference, peak memory",
            "table": res["table"],
            "ratios": [ratio("dpo: peak host memory per rank, precompute_reference / live reference", res["ratio"],
                             0.7, "<=",
                             "full fine-tuning, fsdp2, 2 ranks (bench/benchmarks/dpo_reference/dpo_memory.py)")],
            "raw": res["raw"]}
