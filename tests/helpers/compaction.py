"""tests/rollout/test_grpo_compaction.py's case, shared with the worker it starts: a tiny random Llama whose favourite
token is the EOS, so completions of the same prompts have very different lengths."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, PAD, MAX = 48, 0, 24
CPU = torch.device("cpu")


def model_and_eos() -> tuple[LlamaForCausalLM, list[int]]:
    """A tiny random Llama and, as EOS, the token it favours most after the prompts (besides PAD): some rows
    stop after a few tokens, others run to MAX."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    with torch.no_grad():
        probs = model(input_ids=torch.tensor(PROMPTS[0:1]), use_cache=False).logits.softmax(-1).mean((0, 1))
    probs[PAD] = 0
    return model.train(), [int(probs.argmax())]


PROMPTS = [[1, 4, 6, 9], [1, 5], [1, 7, 9, 11, 4, 30, 31], [1, 8], [3], [1, 40, 41, 42, 43, 44, 45, 46, 47, 2]]
KEYS = [(11, 0, i, g) for i in range(len(PROMPTS)) for g in range(3)]
ROWS = [p for p in PROMPTS for _ in range(3)]
