"""The rollout seam: an Engine samples completions for prompts and reports its own log-probs of the sampled
tokens; an on-policy recipe (GRPO) only asks it for completions, then scores them and trains on them.

    Engine.generate(prompt_ids, keys, sampling) -> Completions    each row keyed (llmtrain.rollout.local)
    Engine.update_weights(step, full)                              the policy after `step` updates
    Engine.fingerprint(names)                                      llmtrain.rollout.sync's, of its own copy

LocalEngine is the keyed sampler (llmtrain.rollout.local) on the training model itself, in the training
processes: every rank samples its own rows, under any parallel strategy (Strategy.unsharded). Its weights are
the policy's (copies_weights False): the recipe gathers nothing for it and checks nothing. TransformersEngine
(here) and VLLMEngine (llmtrain.rollout.vllm) hold their own copy of the policy (copies_weights True): the
recipe gathers the full weights (export.hf_state: Strategy.full_weights, LoRA merged) after each update,
update_weights copies them in, and llmtrain.rollout.sync checks the copy. The registry of grpo.engine's choices
is llmtrain.rollout.registry.

TransformersEngine: transformers' continuous batching (its paged-attention generation path,
PreTrainedModel.generate_batch) in the training processes. Each rank holds a whole Hugging Face model of the
policy's architecture (fp32, attention sdpa) and samples its own rows with it; update_weights copies rank 0's
full weights into every rank's copy, one broadcast per tensor. Continuous batching returns each sampled token's
log-prob after temperature and top-k / top-p (return_logprobs): the drift guard's engine log-probs. Its sampler
is torch.multinomial on one generator seeded per call from the rows' keys: the same rows and weights give the
same completions, but not the local engine's keyed ones, and a row's completion depends on the other rows of
its call (not reproducible across world sizes or micro-batch splits).
"""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Callable, NamedTuple, Protocol

import torch
import torch.distributed as dist
from accelerate import init_empty_weights
from torch import nn
from torch.distributed import ReduceOp
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from llmtrain import distributed
from llmtrain.models.hf import materialize
from llmtrain.rollout.local import Completions as Grid, Sampling, generate, sample_seed
from llmtrain.rollout.sync import fingerprint

PAGE = 64  # tokens per page of TransformersEngine's paged KV cache (sized to each call's rows)


class VLLMServer(NamedTuple):
    """The vLLM server grpo.engine=vllm generates on (llmtrain.rollout.vllm_server)."""
    url: str            # grpo.vllm_server_url
    timeout: float      # grpo.vllm_server_timeout
    group_port: int     # grpo.vllm_group_port


class EngineSetup(NamedTuple):
    """Plain values an engine may size itself by, beside the model (recipes/grpo.py takes them from its config)."""
    max_len: int        # tokens of a row at most: prompt + completion (data.seq_len + grpo.max_completion_length)
    max_rows: int       # rows of one generate call on a rank (train.micro_batch_size x train.grad_accum_steps)
    seed: int           # train.seed
    dtype: torch.dtype  # the training's compute dtype (parallel.mixed_precision)
    workdir: str        # output_dir: where an engine may keep scratch files for the run
    vllm_gpu_memory_utilization: float  # grpo.vllm_gpu_memory_utilization
    vllm_enable_sleep_mode: bool        # grpo.vllm_enable_sleep_mode
    vllm_server: VLLMServer | None = None  # grpo.vllm_server_url and its keys (None: vllm colocated)


class Completions(NamedTuple):
    """An engine's completions, one per prompt row."""
    tokens: list[list[int]]     # each completion's tokens, its first EOS included
    truncated: list[bool]       # max_tokens reached without an EOS
    logps: list[list[float]]    # per completion, the engine's log-prob of each of its tokens under the distribution
                                # it sampled from (logits / temperature, after top-k / top-p): the drift guard's
    seconds: float              # sampling time on this rank


def completion_metrics(out: Completions, device: torch.device) -> dict[str, float]:
    """Collective (every rank, each with as many completions): TRL's completions/mean_length, /min_length,
    /max_length and /clipped_ratio (no EOS within the budget) over every rank's completions, generation_s (the
    slowest rank's sampling time) and generated_tokens_per_s (every rank's tokens over it)."""
    lengths = distributed.gather_rows(torch.tensor([len(t) for t in out.tokens], device=device)).cpu()
    truncated = distributed.gather_rows(torch.tensor(out.truncated, device=device).long()).cpu()
    seconds = distributed.all_reduce(torch.tensor(out.seconds, device=device), ReduceOp.MAX).item()
    return {"completions/mean_length": lengths.float().mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": truncated.float().mean().item(),
            "generation_s": seconds, "generated_tokens_per_s": lengths.sum().item() / max(seconds, 1e-9)}


class Engine(Protocol):
    """Built as ENGINES[grpo.engine](model, model_config, autocast, eos_ids, pad_id, device, setup): the training
    model, its Hugging Face config, the training's autocast, the stop ids, the padding id, the rank's device and
    the EngineSetup."""
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


def listed(out: Grid, seconds: float) -> Completions:
    """An engine's Completions from llmtrain.rollout.local's (a padded grid with log-probs)."""
    lengths = out.lengths.tolist()
    return Completions([r[:n] for r, n in zip(out.ids.tolist(), lengths)], out.truncated.tolist(),
                       [r[:n] for r, n in zip(out.logps.tolist(), lengths)], seconds)


class LocalEngine:
    """The keyed sampler on the training model (llmtrain.rollout.local.generate)."""
    copies_weights, weights_dtype = False, None

    def __init__(self, model: nn.Module, model_config, autocast: Callable[[], contextlib.AbstractContextManager],
                 eos_ids: list[int], pad_id: int, device: torch.device, setup: EngineSetup | None = None):
        # setup is unused: it sizes nothing of its own (recipes/distill.py, which has no grpo keys, passes none)
        self.model, self.autocast, self.eos, self.pad, self.device = model, autocast, eos_ids, pad_id, device

    def generate(self, prompt_ids, keys, sampling) -> Completions:
        t0 = time.perf_counter()
        with self.autocast():
            out = generate(self.model, prompt_ids, keys, sampling, self.eos, self.pad, self.device)
        return listed(out, time.perf_counter() - t0)

    def update_weights(self, step: int, full: dict[str, torch.Tensor]) -> None:
        """Samples from the training model itself: its weights are always the policy's."""


class TransformersEngine:
    """Continuous batching on a whole copy of the policy per rank (the module's docstring)."""
    copies_weights, weights_dtype = True, torch.float32

    def __init__(self, model: nn.Module, model_config, autocast: Callable[[], contextlib.AbstractContextManager],
                 eos_ids: list[int], pad_id: int, device: torch.device, setup: EngineSetup):
        # Its own model from the policy's config: the weights arrive with update_weights; it runs in continuous
        # batching's thread, which the training's autocast (thread-local) does not reach.
        config = copy.deepcopy(model_config)
        config._attn_implementation = "sdpa"  # the training's may be a kernel registered for training only
        with init_empty_weights(include_buffers=False):  # no random init: NaN until the first push
            self.model = AutoModelForCausalLM.from_config(config, dtype=self.weights_dtype)
        materialize(self.model, device)
        self.model.tie_weights()
        self.model.eval().requires_grad_(False)
        self.eos, self.pad = sorted(set(eos_ids)), pad_id

    def update_weights(self, step: int, full: dict[str, torch.Tensor]) -> None:
        for name, tensor in self.model.state_dict().items():  # a tied weight twice: harmless
            if full:
                tensor.copy_(full[name])
            dist.broadcast(tensor, src=0)

    def fingerprint(self, names: list[str]) -> dict[str, float]:
        return fingerprint(self.model.state_dict(), names, self.weights_dtype)

    def generate(self, prompt_ids, keys, sampling) -> Completions:
        rows = len(prompt_ids)
        # An explicit cache size: left to itself, continuous batching sizes it from the device's free memory (on
        # a CPU, the host's: tens of seconds to allocate at each call).
        pages = sum(-(-(len(p) + sampling.max_tokens) // PAGE) for p in prompt_ids)
        batching = ContinuousBatchingConfig(return_logprobs=True, page_size=PAGE, num_blocks=pages + 1,
                                            max_batch_tokens=sum(map(len, prompt_ids)) + rows, use_cuda_graph=False,
                                            seed=sample_seed(*(k for key in keys for k in key)) % 2**31)
        config = GenerationConfig(do_sample=True, max_new_tokens=sampling.max_tokens,
                                  temperature=sampling.temperature, top_k=sampling.top_k or None,
                                  top_p=sampling.top_p, eos_token_id=self.eos, pad_token_id=self.pad)
        t0 = time.perf_counter()
        results = self.model.generate_batch([list(p) for p in prompt_ids], generation_config=config,
                                            continuous_batching_config=batching, progress_bar=False, warmup=False)
        seconds = time.perf_counter() - t0
        if len(results) != rows or any(r.error is not None for r in results.values()):
            errors = [r.error for r in results.values() if r.error is not None]
            raise RuntimeError(f"grpo.engine=transformers: continuous batching returned {len(results)} of {rows} "
                               f"completions{f' ({errors[0]})' if errors else ''}")
        tokens, logps, truncated = [], [], []
        for result in results.values():  # in the order of the inputs
            ids = list(result.generated_tokens)
            n = next((i + 1 for i, t in enumerate(ids) if t in self.eos), len(ids))
            tokens.append(ids[:n])
            logps.append([float(x) for x in result.logprobs[:n]])
            truncated.append(not ids[:n] or ids[n - 1] not in self.eos)
        return Completions(tokens, truncated, logps, seconds)
