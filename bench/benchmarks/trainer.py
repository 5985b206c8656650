"""`trainer` (python bench/run.py --only trainer): useful (trained, non-pad) tokens/s on data/demo/chat.jsonl at
llama-32k: the recipe (chat format, packing, DDP) vs transformers.Trainer (bench/baselines/hf_trainer.py: padding per
batch with DataCollatorForSeq2Seq, DDP through accelerate), same model, steps and ranks. Target >= 1.3x."""

from __future__ import annotations

from benchmarks.base import Ctx
from benchmarks.versus import vs_hf


def bench(ctx: Ctx) -> dict:
    return vs_hf(ctx, "trainer")
