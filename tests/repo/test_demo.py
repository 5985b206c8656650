"""The README's demo: configs/demo.yaml on 2 processes trains and exports (shortened here)."""

from __future__ import annotations

import pytest

from helpers import REPO
from helpers.procs import read_metrics, run_recipe


@pytest.mark.slow
def test_demo_loss_falls_and_exports(tmp_path):
    # 20 of the demo's 150 steps, with a shorter warm-up: the loss falls by ~30% (6.3 -> 0.9 in the full run).
    run_recipe(tmp_path, "train.max_steps=20", "train.warmup_steps=3", "log.every_steps=5", nproc=2,
               config=REPO / "configs" / "demo.yaml")
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(5, 21, 5))
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "elapsed_s"} <= r.keys()
    loss = [r["loss"] for r in records]
    assert all(a > b for a, b in zip(loss, loss[1:])) and loss[-1] < 0.8 * loss[0], loss
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert (tmp_path / "config.yaml").is_file()
