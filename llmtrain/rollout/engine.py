"""The rollout seam: an Engine samples completions for prompts and reports its own log-probs of the sampled
tokens; an on-policy recipe (GRPO) only asks it for completions, then scores them and trains on them.

    Engine.generate(prompt_ids, keys, sampling) -> Completions    each row keyed (llmtrain.rollout.local)
    Engine.update_weights(step)                                    the policy after `step` updates

LocalEngine is the keyed sampler (llmtrain.rollout.local) on the training model itself, in the training
processes: every rank samples its own rows, under any parallel strategy (Strategy.unsharded). Its weights are
the policy's, so update_weights has nothing to do; an engine in other processes (transformers' continuous
batching, vLLM) would receive Strategy.full_weights there.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, NamedTuple, Protocol

import torch
from torch import nn

from llmtrain.config import ConfigError
from llmtrain.rollout.local import Sampling, generate


class Completions(NamedTuple):
    """An engine's completions, one per prompt row."""
    tokens: list[list[int]]     # each completion's tokens, its first EOS included
    truncated: list[bool]       # max_tokens reached without an EOS
    logps: list[list[float]]    # per completion, the engine's log-prob of each of its tokens under the distribution
                                # it sampled from (logits / temperature, after top-k / top-p): the drift guard's
    seconds: float              # sampling time on this rank


class Engine(Protocol):
    def generate(self, prompt_ids: list[list[int]], keys: list[tuple[int, ...]], sampling: Sampling) -> Completions:
        """One completion per prompt row (repeat a prompt G times with G keys for a group). Collective when the
        engine runs in the training processes: every rank calls it with its own rows (at least one)."""

    def update_weights(self, step: int) -> None:
        """The policy's weights after `step` optimizer updates are what the next generate samples from."""


class LocalEngine:
    """The keyed sampler on the training model (llmtrain.rollout.local.generate)."""

    def __init__(self, model: nn.Module, autocast: Callable[[], contextlib.AbstractContextManager],
                 eos_ids: list[int], pad_id: int, device: torch.device):
        self.model, self.autocast, self.eos, self.pad, self.device = model, autocast, eos_ids, pad_id, device

    def generate(self, prompt_ids, keys, sampling) -> Completions:
        t0 = time.perf_counter()
        with self.autocast():
            out = generate(self.model, prompt_ids, keys, sampling, self.eos, self.pad, self.device)
        seconds = time.perf_counter() - t0
        lengths = out.lengths.tolist()
        return Completions([r[:n] for r, n in zip(out.ids.tolist(), lengths)], out.truncated.tolist(),
                           [r[:n] for r, n in zip(out.logps.tolist(), lengths)], seconds)

    def update_weights(self, step: int) -> None:
        """Samples from the training model itself: its weights are always the policy's."""


ENGINES = {"local": LocalEngine}  # grpo.engine's choices built so far (transformers and vllm: docs/grpo.md)


def check_engine(name: str, cuda: bool) -> None:
    """grpo.engine at set-up (its choices are GRPOSection's Literal): vllm on a CUDA device only, and built."""
    if name == "vllm" and not cuda:
        raise ConfigError("grpo.engine: vllm runs on CUDA GPUs only and this run is on CPU; use grpo.engine=local")
    if name not in ENGINES:
        raise ConfigError(f"grpo.engine: {name} is not wired into recipes/grpo.py yet; use grpo.engine=local")
