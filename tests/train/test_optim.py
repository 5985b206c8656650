"""optim.lr_at (warm-up, then constant / linear / cosine decay to min_lr_ratio x peak at max_steps) and
optim.no_decay_names (1-D parameters: norms and biases; embeddings and other matrices decay)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llmtrain import optim
from llmtrain.config import TrainConfig

PEAK = 2.0


def schedule(kind: str, warmup: int = 4, max_steps: int = 14, min_lr_ratio: float = 0.1) -> list[float]:
    section = TrainConfig(lr_schedule=kind, warmup_steps=warmup, max_steps=max_steps, min_lr_ratio=min_lr_ratio)
    return [optim.lr_at(step, section, PEAK) for step in range(max_steps + 2)]  # 2 steps past the end too


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_warmup_is_linear_from_peak_over_warmup_steps_to_peak(kind):
    assert schedule(kind)[:5] == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.0])  # step 3 (0-based) reaches the peak


def test_constant_stays_at_peak_after_warmup():
    assert schedule("constant")[4:] == pytest.approx([PEAK] * 12)


def test_linear_decays_in_equal_steps_to_the_floor_at_max_steps_and_stays():
    lrs = schedule("linear")  # 10 decay steps from 2.0 to 0.2: 0.18 each
    assert lrs[4:] == pytest.approx([2.0 - 0.18 * i for i in range(11)] + [0.2])


def test_cosine_follows_half_a_cosine_to_the_floor_at_max_steps_and_stays():
    lrs = schedule("cosine")
    floor = PEAK * 0.1
    want = [floor + (PEAK - floor) * 0.5 * (1 + math.cos(math.pi * i / 10)) for i in range(11)]
    assert lrs[4:] == pytest.approx(want + [floor])
    assert lrs[9] == pytest.approx((PEAK + floor) / 2)  # halfway through the decay: halfway down
    assert all(a > b for a, b in zip(lrs[4:14], lrs[5:15]))  # strictly decreasing until max_steps


def test_no_warmup_starts_at_peak_and_zero_floor_ends_at_zero():
    for kind in ("linear", "cosine"):
        lrs = schedule(kind, warmup=0, max_steps=8, min_lr_ratio=0.0)
        assert lrs[0] == PEAK and lrs[8] == pytest.approx(0.0, abs=1e-12), kind


def test_no_decay_names_are_norms_and_biases_not_embeddings_or_matrices():
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, attention_bias=True, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    names = {n for n, _ in model.named_parameters()}
    no_decay = optim.no_decay_names(model)
    biases = {f"model.layers.{i}.self_attn.{p}_proj.bias" for i in (0, 1) for p in "qkvo"}
    norms = {f"model.layers.{i}.{n}.weight" for i in (0, 1) for n in ("input_layernorm", "post_attention_layernorm")}
    assert no_decay == biases | norms | {"model.norm.weight"}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.up_proj.weight",
            "model.layers.1.self_attn.q_proj.weight"} <= names - no_decay
