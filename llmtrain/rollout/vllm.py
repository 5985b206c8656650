"""vLLM's side of the rollout seam (grpo.engine=vllm; not wired into recipes/grpo.py yet): the requests for the
keyed rows of llmtrain.rollout.local.generate and their answers read back as its Completions, with the sampled
tokens' log-probs (the drift guard's). Plain dicts and duck-typed outputs: vllm is imported by whoever calls
vllm.LLM.generate, so this module and its tests run without it."""

from __future__ import annotations

import torch

from llmtrain.rollout.local import Completions, Sampling, from_lists, sample_seed


def vllm_requests(prompts: list[list[int]], keys: list[tuple[int, ...]], sampling: Sampling,
                  eos_ids: list[int]) -> list[tuple[dict, dict]]:
    """The vLLM requests of generate's rows: (TokensPrompt, SamplingParams keyword arguments) each, one
    completion per request seeded from its key (vLLM's per-request generator: reproducible by key, not the
    local sampler's tokens), the sampled token's log-prob returned (logprobs=0; an LLM built with
    logprobs_mode="processed_logprobs" gives it after temperature and top-k / top-p, as generate's), stopping
    at every EOS id. Plain dicts: vllm is imported by whoever calls it."""
    params = {"n": 1, "temperature": sampling.temperature, "top_p": sampling.top_p,
              "top_k": sampling.top_k or -1, "max_tokens": sampling.max_tokens, "logprobs": 0,
              "stop_token_ids": sorted(set(eos_ids))}
    return [({"prompt_token_ids": list(p)}, {**params, "seed": sample_seed(*key)}) for p, key in zip(prompts, keys)]


def from_vllm(outputs: list, eos_ids: list[int], pad_id: int) -> Completions:
    """Completions (with log-probs) from vLLM's RequestOutputs in request order: each one's first
    CompletionOutput's token_ids up to and including the first EOS, and the sampled token's Logprob at each
    position; truncated when no EOS was sampled (finish_reason "length")."""
    eos, tokens, logps = set(eos_ids), [], []
    for request in outputs:
        out = request.outputs[0]
        ids = list(out.token_ids)
        n = next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))
        if out.logprobs is None or len(out.logprobs) < n:
            raise ValueError("from_vllm: a completion came without a log-prob per token; sample with logprobs=0")
        tokens.append(ids[:n])
        logps.append([out.logprobs[i][t].logprob for i, t in enumerate(ids[:n])])
    done = from_lists(tokens, [not (row and row[-1] in eos) for row in tokens], pad_id)
    grid = torch.zeros(done.ids.shape)
    for i, row in enumerate(logps):
        grid[i, :len(row)] = torch.tensor(row)
    return done._replace(logps=grid)
