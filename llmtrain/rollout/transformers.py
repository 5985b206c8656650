"""rollout.engine=transformers: transformers' continuous batching (its paged-attention generation path,
PreTrainedModel.generate_batch) in the training processes. Each rank holds a whole Hugging Face model of the
policy's architecture (fp32, attention sdpa) and samples its own rows with it; update_weights copies rank 0's
full weights into every rank's copy, one broadcast per tensor. Continuous batching returns each sampled token's
log-prob after temperature and top-k / top-p (return_logprobs): the drift guard's engine log-probs. Its sampler
is torch.multinomial on one generator seeded per call from the rows' keys: the same rows and weights give the
same completions, but not the local engine's keyed ones, and a row's completion depends on the other rows of
its call (not reproducible across world sizes or micro-batch splits).
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from llmtrain.models.hf import materialize
from llmtrain.rollout.engine import Completions, EngineSetup
from llmtrain.rollout.local import sample_seed
from llmtrain.rollout.section import RolloutSection
from llmtrain.rollout.sync import fingerprint

PAGE = 64  # tokens per page of TransformersEngine's paged KV cache (sized to each call's rows)


class TransformersEngine:
    """Continuous batching on a whole copy of the policy per rank (the module's docstring)."""
    copies_weights, weights_dtype = True, torch.float32

    def __init__(self, section: RolloutSection, setup: EngineSetup):
        # Its own model from the policy's config: the weights arrive with update_weights; it runs in continuous
        # batching's thread, which the training's autocast (thread-local) does not reach.
        config = copy.deepcopy(setup.model_config)
        config._attn_implementation = "sdpa"  # the training's may be a kernel registered for training only
        with init_empty_weights(include_buffers=False):  # no random init: NaN until the first push
            self.model = AutoModelForCausalLM.from_config(config, dtype=self.weights_dtype)
        materialize(self.model, setup.device)
        self.model.tie_weights()
        self.model.eval().requires_grad_(False)
        self.eos, self.pad = sorted(set(setup.eos_ids)), setup.pad_id

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
            raise RuntimeError(f"rollout.engine=transformers: continuous batching returned {len(results)} of {rows} "
                               f"completions{f' ({errors[0]})' if errors else ''}")
        tokens, logps, truncated = [], [], []
        for result in results.values():  # in the order of the inputs
            ids = list(result.generated_tokens)
            n = next((i + 1 for i, t in enumerate(ids) if t in self.eos), len(ids))
            tokens.append(ids[:n])
            logps.append([float(x) for x in result.logprobs[:n]])
            truncated.append(not ids[:n] or ids[n - 1] not in self.eos)
        return Completions(tokens, truncated, logps, seconds)
