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

from llmtrain.data.formats import IGNORE
from llmtrain.losses.token import next_token_targets
from llmtrain.rollout.local import Sampling, generate
from llmtrain.rollout.rows import micro_batches


class Completions(NamedTuple):
    """An engine's completions, one per prompt row."""
    tokens: list[list[int]]           # each completion's tokens, its first EOS included
    truncated: list[bool]             # max_tokens reached without an EOS
    logps: list[torch.Tensor] | None  # per completion, the engine's log-prob of each of its tokens (logits /
                                      # temperature), fp32; None when not asked for
    seconds: float                    # sampling time on this rank


class Engine(Protocol):
    def generate(self, prompt_ids: list[list[int]], keys: list[tuple[int, ...]], sampling: Sampling) -> Completions:
        """One completion per prompt row (repeat a prompt G times with G keys for a group). Collective when the
        engine runs in the training processes: every rank calls it with its own rows (at least one)."""

    def update_weights(self, step: int) -> None:
        """The policy's weights after `step` optimizer updates are what the next generate samples from."""


class LocalEngine:
    """The keyed sampler on the training model (llmtrain.rollout.local.generate). With logps_batch, each
    completion's log-probs come from a no-grad forward of the model over the training rows in micro-batches of
    that many (token_logps: the loss's own, so that a ratio against them starts at exactly 1)."""

    def __init__(self, model: nn.Module, autocast: Callable[[], contextlib.AbstractContextManager],
                 eos_ids: list[int], pad_id: int, device: torch.device,
                 token_logps: Callable[[nn.Module, dict, float], torch.Tensor] | None = None,
                 logps_batch: int = 0):
        self.model, self.autocast, self.eos, self.pad, self.device = model, autocast, eos_ids, pad_id, device
        self.token_logps, self.logps_batch = token_logps, logps_batch

    def generate(self, prompt_ids, keys, sampling) -> Completions:
        t0 = time.perf_counter()
        with self.autocast():
            out = generate(self.model, prompt_ids, keys, sampling, self.eos, self.pad, self.device)
        seconds = time.perf_counter() - t0
        tokens = [r[:n] for r, n in zip(out.ids.tolist(), out.lengths.tolist())]
        truncated = out.truncated.tolist()
        logps = self._logps(prompt_ids, tokens, truncated, sampling.temperature) if self.logps_batch else None
        return Completions(tokens, truncated, logps, seconds)

    def _logps(self, prompt_ids, tokens, truncated, temperature: float) -> list[torch.Tensor]:
        out = []
        for b in micro_batches(prompt_ids, tokens, truncated, self.pad, self.logps_batch, False, self.device):
            with torch.no_grad(), self.autocast():
                flat = self.token_logps(self.model, b, temperature)
            out += flat.split((next_token_targets(b["labels"]) != IGNORE).sum(1).tolist())
        return out

    def update_weights(self, step: int) -> None:
        """Samples from the training model itself: its weights are always the policy's."""
