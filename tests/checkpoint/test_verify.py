"""checkpoint.verify on a checkpoint written by the library's own save (CheckpointManager in a real 1-rank gloo
group: DCP shards, RNG state, manifest, completion marker): [] when intact, and each kind of damage named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from helpers import REPO
from llmtrain.checkpoint import CheckpointManager, TrainState, verify
from llmtrain.config import CheckpointConfig
from llmtrain.models.hf import load_tokenizer


@pytest.fixture
def saved(tmp_path, single_process_group) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()  # AdamW moments in the checkpoint too
    manager = CheckpointManager(CheckpointConfig(), str(tmp_path), model, opt, 0, "seed: 0\n",
                                LlamaConfig(hidden_size=64), load_tokenizer(str(REPO / "assets" / "tokenizer"), False))
    return manager.save(TrainState(step=1, world_size=1))


def test_intact_checkpoint_has_no_problems(saved):
    assert {"__0_0.distcp", ".metadata", "rng_rank0.json", "manifest.json", "trainer_state.json"} <= {
        p.name for p in saved.iterdir()}
    assert verify(saved) == []


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,problem", [
    (lambda ck: (ck / "rng_rank0.json").unlink(), "rng_rank0.json is missing"),
    (lambda ck: (ck / "__0_0.distcp").write_bytes((ck / "__0_0.distcp").read_bytes()[:100]),
     r"__0_0.distcp is 100 bytes, \d+ when saved \(truncated\?\)"),
    (lambda ck: flip_a_byte(ck / "__0_0.distcp"), r"__0_0.distcp has changed since it was saved \(xxh3_64 differs\)"),
    (lambda ck: (ck / "manifest.json").write_text("{not json"), r"manifest.json is unreadable \(.+\)"),
    (lambda ck: (ck / "manifest.json").write_text("{}"), r"manifest.json is unreadable \('files'\)"),
    (lambda ck: (ck / ".metadata").unlink(), r"no .metadata \(DCP's index of the shards\): the save did not finish"),
    (lambda ck: (ck / "trainer_state.json").unlink(),
     r"no trainer_state.json \(the completion marker\): the save did not finish"),
], ids=["missing", "truncated", "changed", "not_json", "no_files", "no_metadata", "no_trainer_state"])
def test_damage_is_named(saved, damage, problem):
    damage(saved)
    problems = verify(saved)
    assert len(problems) == 1 and re.fullmatch(problem, problems[0]), problems
