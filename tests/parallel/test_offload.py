"""train.activation_offloading (llmtrain/models/offload.py): the saved-tensor hooks move what the forward saves to a
host copy and back for the backward, changing no number: the loss and every gradient of a tiny Llama (the chunked
loss's own autograd Functions, the full loss, activation checkpointing) are bit-identical with and without them,
with tensors moved and no parameter among them; on a CPU run the key is a no-op said in one line."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from llmtrain.losses.token import TokenLoss
from llmtrain.models import attention, offload
from llmtrain.parallelize import apply_activation_checkpointing

CPU = torch.device("cpu")


def tiny_llama() -> nn.Module:
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=96)
    config._attn_implementation = attention.NAME
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).train()


def batch() -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (2, 24), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(24).expand(2, -1)}


def loss_and_grads(model: nn.Module, impl: str, saved) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with saved():
        loss = TokenLoss(impl, model, CPU).loss_sum(model, batch())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("impl, checkpointing", [("chunked", False), ("full", False), ("chunked", True)])
def test_offloaded_activations_change_no_number(impl, checkpointing):
    model = tiny_llama()
    if checkpointing:
        apply_activation_checkpointing(model)
    plain = loss_and_grads(model, impl, contextlib.nullcontext)
    hooks = offload.SavedToHost(CPU, min_bytes=0)
    kept = []  # (saved tensor, whether it stayed)

    def pack(t):
        out = hooks.pack(t)
        kept.append((t, out is t))
        return out

    def saved():
        return torch.autograd.graph.saved_tensors_hooks(pack, hooks.unpack)

    moved = loss_and_grads(model, impl, saved)
    assert hooks.moved > 10, hooks.moved
    for t, stayed in kept:  # at min_bytes 0 only the parameters and their views (a weight's transpose) stay
        assert stayed == (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)), (t.shape, stayed)
    assert any(stayed for _, stayed in kept)
    assert torch.equal(plain[0], moved[0])
    for a, b in zip(plain[1], moved[1]):
        assert torch.equal(a, b)


def test_small_tensors_stay():
    hooks = offload.SavedToHost(CPU)  # MIN_BYTES: 1 MiB
    small, large = torch.zeros(16), torch.zeros(offload.MIN_BYTES // 4)
    assert hooks.pack(small) is small
    packed = hooks.pack(large)
    assert packed[0] is not large and torch.equal(hooks.unpack(packed), large) and hooks.moved == 1


def test_cpu_run_is_a_no_op_said_in_one_line():
    saved, line = offload.for_run(True, CPU)
    assert saved is contextlib.nullcontext
    assert line.startswith("train.activation_offloading: a no-op on cpu") and "\n" not in line
    assert offload.for_run(False, CPU) == (contextlib.nullcontext, "")
