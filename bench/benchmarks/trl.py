"""`trl` (python bench/run.py --only trl): the same against TRL's SFTTrainer (bench/baselines/trl_sft.py: packing and
assistant-only loss on), run from its own venv (--trl-venv, created with python3 -m venv + pip when missing), with
peak memory per rank. Target >= 2x."""

from __future__ import annotations

from benchmarks.base import Ctx
from benchmarks.versus import vs_hf


def bench(ctx: Ctx) -> dict:
    return vs_hf(ctx, "trl")
