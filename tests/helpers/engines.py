"""What the engine tests share (tests/rollout/test_grpo_engines.py, test_grpo_vllm.py): the weight-sync check of an
engine's copy after an update it did not get."""

from __future__ import annotations

import pytest
import torch

from llmtrain.config import RunError
from llmtrain.export import hf_state
from llmtrain.parallelize import STRATEGIES
from llmtrain.rollout import sync


def stale_copy_is_caught(trainer: torch.nn.Module, engine, name: str, bump: float, seed: int) -> None:
    """Every trainer weight moves by `bump` (every element: any slice sees it) without a push: sync.check stops step
    2 with its one line naming the first fingerprinted parameter; after the push it passes."""
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(bump)
    moved = hf_state(trainer, STRATEGIES["none"], torch.device("cpu"))
    stale = sync.trainer_fingerprint(moved, seed, 1, engine.weights_dtype)
    with pytest.raises(RunError) as e:
        sync.check(stale, engine.fingerprint(list(stale)), 1, name)
    first = next(iter(stale))
    assert str(e.value) == (f"rollout.engine={name}: after the weight push for step 2, rank 0's engine differs from "
                            f"the trainer on {first} (fingerprint {engine.fingerprint([first])[first]!r} vs "
                            f"{stale[first]!r}): it would sample from stale weights")
    engine.update_weights(1, moved)  # pushed: equal again
    sync.check(stale, engine.fingerprint(list(stale)), 1, name)
