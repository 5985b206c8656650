"""The on-policy distillation runs' shared set-up (tests/test_distill_on_policy.py,
tests/test_distill_on_policy_engines.py): instruction rows whose completions fill the tiny models' positions, the
sampling settings, the 2-rank fsdp2-with-accumulation layout and the completion metrics every on-policy step logs."""

from __future__ import annotations

from pathlib import Path

from helpers import REPO
from helpers.distill import distill_args

INSTRUCT = REPO / "data" / "demo" / "instruct.jsonl"
SEQ_LEN, NEW, SAMPLING_T = 48, 16, 0.9  # 48 + 16 positions: the tiny models' max_position_embeddings
# The random student rarely samples the tokenizer's EOS; 212, one of its likeliest tokens, as a second stop id of
# its config ends about half its completions early, so that rows and micro-batches differ in length.
ROWS = (f"data.path={INSTRUCT}", "data.format=instruction", f"data.seq_len={SEQ_LEN}",
        f"distill.max_new_tokens={NEW}", f"distill.sampling_temperature={SAMPLING_T}",
        "model.config.eos_token_id=[1,212]")
FSDP2_ACCUM = ("parallel.strategy=fsdp2", "train.micro_batch_size=1", "train.grad_accum_steps=2")
COMPLETIONS = ("completions/mean_length", "completions/min_length", "completions/max_length",
               "completions/clipped_ratio")


def on_policy_args(teacher: Path, fraction: float, *extra: str) -> list[str]:
    """distill_args with the rows above and distill.on_policy_fraction=fraction."""
    return distill_args(teacher, *ROWS, f"distill.on_policy_fraction={fraction}", *extra)
