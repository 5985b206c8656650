"""The rollout seam: an Engine samples completions for prompts and reports its own log-probs of the sampled
tokens; an on-policy recipe (GRPO, on-policy distillation) only asks it for completions, then scores them and
trains on them.

    Engine.generate(prompt_ids, keys, sampling) -> Completions    each row keyed (llmtrain.rollout.local)
    Engine.update_weights(step, full)                              the policy after `step` updates
    Engine.fingerprint(names)                                      llmtrain.rollout.sync's, of its own copy

One module per engine: llmtrain.rollout.local's LocalEngine is the keyed sampler on the training model
itself, in the training processes: every rank samples its own rows, under any parallel strategy
(Strategy.unsharded). Its weights are the policy's (copies_weights False): nothing is gathered for it and
nothing checked. llmtrain.rollout.transformers' TransformersEngine, llmtrain.rollout.vllm's VLLMEngine and
llmtrain.rollout.vllm_server's VLLMServerEngine hold their own copy of the policy (copies_weights True):
llmtrain.rollout.sync.WeightSync gathers the full weights (export.hf_state: Strategy.full_weights, LoRA merged)
before each generation batch, update_weights copies them in, and the fingerprint check compares the copy. The
rollout.engine key picks one (llmtrain.rollout.section; llmtrain.rollout.registry.build makes it).
This module holds what they share: the protocol, Sampling, EngineSetup and Completions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    import contextlib

    from torch import nn



@dataclass(frozen=True)
class Sampling:
    """How a generate call samples (the recipe's sampling keys: grpo.*, distill.*)."""
    max_tokens: int
    """Tokens sampled per completion at most (grpo.max_completion_length)."""
    temperature: float = 1.0
    top_p: float = 1.0
    """Nucleus: keep the most likely tokens whose probabilities sum to top_p (HF's TopPLogitsWarper)."""
    top_k: int = 0
    """Keep the top_k most likely tokens (0: all)."""


class EngineSetup(NamedTuple):
    """The run's plain values an engine is built from, beside the rollout: section (registry.build fills it)."""
    model: nn.Module      # the training model (wrapped by its strategy)
    model_config: object  # its Hugging Face config
    autocast: Callable[[], contextlib.AbstractContextManager]  # the training's autocast
    eos_ids: list[int]    # the stop ids
    pad_id: int
    device: torch.device  # the rank's device
    max_len: int          # tokens of a row at most: prompt + completion (data.seq_len + grpo.max_completion_length)
    max_rows: int         # rows of one generate call on a rank
    seed: int             # train.seed
    dtype: torch.dtype    # the training's compute dtype (parallel.mixed_precision)
    workdir: str          # output_dir: where an engine may keep scratch files for the run


class Completions(NamedTuple):
    """An engine's completions, one per prompt row."""
    tokens: list[list[int]]     # each completion's tokens, its first EOS included
    truncated: list[bool]       # max_tokens reached without an EOS
    logps: list[list[float]]    # per completion, the engine's log-prob of each of its tokens under the distribution
                                # it sampled from (logits / temperature, after top-k / top-p): the drift guard's
    seconds: float              # sampling time on this rank
    tool_mask: list[list[int]] | None = None  # a multi-turn trajectory's (llmtrain.rollout.agent): 1 for the model's
                                # tokens, 0 for the tool messages' rendered between its turns (logps 0 there)


class Engine(Protocol):
    """Built as ENGINES[rollout.engine](section, setup) (llmtrain.rollout.registry.build): the rollout: section and
    the run's EngineSetup."""
    copies_weights: bool
    """Whether the engine samples from its own copy of the policy (update_weights copies, sync checks it)."""
    weights_dtype: torch.dtype | None
    """The dtype of that copy: the trainer's fingerprint is taken in it (None: no copy)."""

    def generate(self, prompt_ids: list[list[int]], keys: list[tuple[int, ...]], sampling: Sampling) -> Completions:
        """One completion per prompt row (repeat a prompt G times with G keys for a group). Collective when the
        engine runs in the training processes: every rank calls it with its own rows (at least one)."""

    def update_weights(self, step: int, full: dict[str, torch.Tensor]) -> None:
        """Collective. The policy's weights after `step` optimizer updates are what the next generate samples
        from; `full`: those weights by Hugging Face names, LoRA merged, on rank 0 ({} on the other ranks and
        when copies_weights is False: nothing was gathered)."""

    def fingerprint(self, names: list[str]) -> dict[str, float]:
        """llmtrain.rollout.sync.fingerprint of the weights it samples with (an engine that copies_weights)."""
