"""A recipe's own state (CheckpointManager.register): saved with every checkpoint, covered by its manifest,
restored on resume (per-rank state only at the same world size, as the RNG), for real on a 1-rank gloo group."""

from __future__ import annotations

import json

import pytest
import torch

from llmtrain import checkpoint
from llmtrain.config import CheckpointConfig
from llmtrain.models.hf import load_tokenizer


class Counter:
    """A stand-in for a recipe's sampling state: what it holds must come back exactly."""

    def __init__(self, value: int = 0):
        self.value, self.seen = value, []

    def state_dict(self) -> dict:
        return {"value": self.value, "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.seen = state["value"], state["seen"]


def manager(out, model, opt) -> checkpoint.CheckpointManager:
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=8, hidden_size=4, num_attention_heads=1)
    return checkpoint.CheckpointManager(CheckpointConfig(every_steps=1), str(out), model, opt, 0, "x: 1\n", config,
                                        load_tokenizer("assets/tokenizer", False))


def test_registered_state_is_saved_verified_and_resumed(tmp_path, single_process_group, monkeypatch):
    monkeypatch.chdir(checkpoint.Path(__file__).resolve().parents[2])
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    saver = manager(tmp_path, model, opt)
    shared, mine = Counter(3), Counter(5)
    shared.seen, mine.seen = [1, 2], [7]
    saver.register("sampler", shared)
    saver.register("buffer", mine, per_rank=True)
    with pytest.raises(ValueError, match="registered twice"):
        saver.register("sampler", Counter())
    path = saver.save(checkpoint.TrainState(step=1, world_size=1))
    assert json.loads((path / "state" / "sampler.json").read_text()) == {"value": 3, "seen": [1, 2]}
    assert {"state/sampler.json", "state/buffer_rank0.json"} <= json.loads((path / "manifest.json").read_text())[
        "files"].keys()
    assert checkpoint.verify(path) == []

    resumer = manager(tmp_path, model, opt)
    back_shared, back_mine = Counter(), Counter()
    resumer.register("sampler", back_shared)
    resumer.register("buffer", back_mine, per_rank=True)
    assert resumer.resume(checkpoint.choose_resume(resumer.section, tmp_path)).step == 1
    assert (back_shared.value, back_shared.seen, back_mine.value, back_mine.seen) == (3, [1, 2], 5, [7])

    (path / "state" / "sampler.json").write_text(json.dumps({"value": 4, "seen": [1, 2]}))  # same size
    assert any("state/sampler.json has changed" in p for p in checkpoint.verify(path))
