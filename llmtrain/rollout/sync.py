"""Weight sync (WeightSync): before each generation batch, the policy after that many updates goes into the engine;
one that holds its own copy of the policy (rollout.engine=transformers, vllm) gets the full weights and is checked:
after each push, a cheap fingerprint of the engine's weights must equal the trainer's, or the step stops.

A fingerprint is, for PARAMETERS names drawn from the weights' names by a key (the run's seed and the step, so
that a run covers every parameter in time), the float64 sum of a strided slice of about SLICE elements of each,
taken in the engine copy's dtype (Engine.weights_dtype: the trainer's fp32 values rounded as the push rounds
them, so a bf16 copy matches exactly) and summed on the CPU (the same order of additions on both sides).
Both sides take it by Hugging Face names, LoRA adapters merged into their base (export.hf_state): what the
engine samples with. The trainer's comes from the gathered full weights (rank 0, sent to every rank); every
rank checks its own engine and the ranks agree on the outcome (one all-gather), so all stop together.
"""

from __future__ import annotations

import random
from typing import Callable, Mapping

import torch

from llmtrain import distributed
from llmtrain.config import RunError
from llmtrain.rollout.engine import Engine
from llmtrain.rollout.local import sample_seed

PARAMETERS = 4  # names fingerprinted per push
SLICE = 64      # elements summed per name, at most (a stride over the flattened tensor)


def chosen(names: list[str], seed: int, step: int) -> list[str]:
    """PARAMETERS names of `names` drawn by (seed, step): the same on every rank and both sides."""
    ordered = sorted(names)
    return random.Random(sample_seed(seed, step)).sample(ordered, min(PARAMETERS, len(ordered)))


def fingerprint(weights: Mapping[str, torch.Tensor], names: list[str], dtype: torch.dtype) -> dict[str, float]:
    """{name: float64 sum, on the CPU, of every (numel // SLICE)-th element of the flattened tensor in `dtype`}."""
    out = {}
    for name in names:
        flat = weights[name].detach().reshape(-1)
        out[name] = flat[::max(1, flat.numel() // SLICE)].to("cpu", dtype).double().sum().item()
    return out


def trainer_fingerprint(full: Mapping[str, torch.Tensor], seed: int, step: int, dtype: torch.dtype) -> dict[str, float]:
    """Collective: the fingerprint (in the engine copy's `dtype`) of the trainer's full weights, which rank 0 holds
    ({} on the other ranks: export.hf_state), on every rank."""
    return distributed.gather_objects(fingerprint(full, chosen(list(full), seed, step), dtype) if full else None)[0]


def check(trainer: dict[str, float], engine: dict[str, float], step: int, engine_name: str) -> None:
    """Collective: every rank's engine fingerprint equals the trainer's, or every rank raises the same RunError
    naming the step, the engine, the rank and the first parameter that differs."""
    differs = next((n for n in trainer if engine.get(n) != trainer[n]), None)
    parts = distributed.gather_objects(None if differs is None else (differs, engine.get(differs)))
    rank, found = next(((r, p) for r, p in enumerate(parts) if p is not None), (None, None))
    if found is not None:
        name, value = found
        raise RunError(f"rollout.engine={engine_name}: after the weight push for step {step + 1}, rank {rank}'s engine "
                       f"differs from the trainer on {name} (fingerprint {value!r} vs {trainer[name]!r}): "
                       "it would sample from stale weights")


class WeightSync:
    """Pushes the policy into an engine (llmtrain.rollout.registry.build makes one per engine): full_weights()
    gathers the policy's full weights (collective; LoRA merged, on rank 0), seed keys the fingerprint's names."""

    def __init__(self, engine: Engine, engine_name: str, seed: int, full_weights: Callable[[], dict]):
        self.engine, self.engine_name, self.seed, self.full_weights = engine, engine_name, seed, full_weights

    def push(self, step: int) -> None:
        """Collective: the policy after `step` updates into the engine; one that samples from its own copy gets the
        full weights and is checked against them (one line, exit 1, if stale)."""
        copies = self.engine.copies_weights
        full = self.full_weights() if copies else {}
        self.engine.update_weights(step, full)
        if copies:
            trainer = trainer_fingerprint(full, self.seed, step, self.engine.weights_dtype)
            check(trainer, self.engine.fingerprint(list(trainer)), step, self.engine_name)
