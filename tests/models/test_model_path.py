"""The README's bring-your-own example: fine-tune an exported Hugging Face model (model.path, its own tokenizer)
on chat data."""

from __future__ import annotations

import pytest

from helpers import REPO
from helpers.procs import read_metrics, run_recipe


@pytest.mark.slow
def test_bring_your_own_model_and_data(base, tmp_path):
    """The README's example: fine-tune an exported Hugging Face model (model.path) on chat data."""
    run_recipe(tmp_path, "parallel.strategy=none", "model.config=null", f"model.path={base}",
               "tokenizer.path=null", "data.path=data/demo/chat.jsonl", "data.format=chat", "data.seq_len=64",
               "train.max_steps=2", "log.every_steps=1", config=REPO / "configs" / "demo.yaml")
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2] and all(r["loss"] < 7 for r in records)
    assert (tmp_path / "hf" / "model.safetensors").is_file()
