"""`kto` (python bench/run.py --only kto): recipes/kto.py vs TRL's KTOTrainer (bench/baselines/trl_kto.py, TRL's
venv) from one causal-LM directory of llama-32k's shape on data/demo/unpaired.jsonl (bench/configs/llama-32k-kto.yaml:
ddp, 2 ranks, full fine-tuning, a frozen reference copy on both sides): rows/s (both sides train on the same rows per
step, each with its KL rows) and peak memory per rank, --pairs pairs. Target >= 1.5x rows/s, memory <= TRL's."""

from __future__ import annotations

from benchmarks.base import BENCH, Ctx
from benchmarks.versus import Counted, counted_vs_trl
from common import REPO

KTO = Counted("kto", REPO / "recipes" / "kto.py", BENCH / "configs" / "llama-32k-kto.yaml", "trl_kto.py",
              "KTOTrainer", "rows", 1.5,
              lambda c: (f", each side with a frozen reference copy of it. Rows: {c['data']['path']}, max length "
                         f"{c['data']['seq_len']}, micro-batch {c['train']['micro_batch_size']} rows per rank (and as "
                         f"many KL rows), 2 ranks gloo, DDP, fp32, beta {c['kto']['beta']}, full fine-tuning"))


def bench(ctx: Ctx) -> dict:
    """Rows/s of recipes/kto.py vs TRL's KTOTrainer from one model directory, ddp, 2 ranks."""
    return {"title": "KTO: rows/s vs TRL KTOTrainer", **counted_vs_trl(ctx, KTO)}
