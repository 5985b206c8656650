"""The README's demo: configs/demo.yaml on 2 processes trains and exports (shortened here)."""

from __future__ import annotations

import pytest

from conftest import REPO, read_metrics, run_recipe


@pytest.mark.slow
def test_demo_loss_falls_and_exports(tmp_path):
    run_recipe(tmp_path, "train.max_steps=40", "log.every_steps=5", nproc=2, config=REPO / "configs" / "demo.yaml")
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(5, 41, 5))
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "elapsed_s"} <= r.keys()
    assert records[-1]["loss"] < 0.6 * records[0]["loss"], [r["loss"] for r in records]
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert (tmp_path / "config.yaml").is_file()
