"""tests/rollout/test_grpo_generation.py's case, shared with the worker it starts: a tiny Llama over a 16-token
vocabulary and five prompts, each sampled twice (a group of 2), keyed (seed, step, prompt index, generation index)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llmtrain.rollout.local import Sampling

VOCAB, EOS, PAD = 16, [2, 3], 0
CPU = torch.device("cpu")
MODEL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**MODEL)).train()


PROMPTS = [[1, 4, 6], [1, 5], [1, 7, 9, 11, 4], [1, 8, 8, 6], [1, 9]]
SAMPLING = Sampling(max_tokens=12, temperature=0.9, top_p=0.95, top_k=12)


def rows_and_keys(step: int = 3):
    """Each prompt twice (a group of 2), keyed (seed, step, prompt index, generation index)."""
    rows = [(p, (7, step, i, g)) for i, p in enumerate(PROMPTS) for g in range(2)]
    return [r for r, _ in rows], [k for _, k in rows]
