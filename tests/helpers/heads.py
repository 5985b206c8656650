"""The tiny heads of tests/train/test_loss.py and tests/grpo/test_grpo_loss.py: models of three families (tied, untied,
Gemma 2's soft-capped logits) behind a plain or a wrapped output layer, one batch with a prompt, an empty row
and padding, and the loss-and-gradients probe."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig

from llmtrain.data.formats import IGNORE

VOCAB, SEQ = 96, 12
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def tiny(config) -> torch.nn.Module:
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def batch() -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :5] = IGNORE  # a prompt
    labels[1] = IGNORE  # a row with nothing trained
    labels[2, -3:] = IGNORE  # padding
    return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(SEQ).expand(3, -1)}


def loss_and_grads(model, fn) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = fn()
    (loss * 0.37).backward()  # train_step scales the summed loss
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


CONFIGS = pytest.mark.parametrize("config", [
    LlamaConfig(**SMALL, tie_word_embeddings=True),
    LlamaConfig(**SMALL, tie_word_embeddings=False),
    Gemma2Config(**SMALL, head_dim=8, final_logit_softcapping=0.5, tie_word_embeddings=True),
], ids=["llama-tied", "llama-untied", "gemma2-softcap"])


# Both chunked paths: the hand-written gradient of a plain nn.Linear output layer, and autograd per chunk
# for any other output module (a wrapper such as PEFT's modules_to_save).
HEADS = pytest.mark.parametrize("head", ["linear", "wrapped"])


def tiny_head(config, head: str) -> torch.nn.Module:
    model = tiny(config)
    if head == "wrapped":
        model.get_output_embeddings().__class__ = type("WrappedHead", (torch.nn.Linear,), {})
    return model
