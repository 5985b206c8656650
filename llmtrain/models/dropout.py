"""Keyed dropout: a mask that is a function of (train.seed, step, the row's sample in the step's global batch,
the layer) and of nothing else: not of the rank, the world size, the micro-batch split, the row's padding or
a resume. LoRA's adapter dropout (lora.dropout) uses it in place of PEFT's nn.Dropout, so that LoRA runs keep
the house rule (any split gives the same losses; a resume continues exactly) with dropout on.

The training step (llmtrain.train.step.accumulate) sets the step's key and each micro-batch's sample
indices around its forward and backward (`rows`); the batches carry them (llmtrain.data's SAMPLE_INDEX: the
data pipeline numbers a step's global batch, llmtrain.data.sampling; GRPO numbers its completions). A
micro-batch's rows come in blocks of its B samples: row r is sample r % B's part r // B (DPO's
collate_pairs: chosen rows, then rejected rows; one part otherwise). An activation-checkpointing recompute
runs inside the same block and draws the same mask.

The mask is a counter-based hash, computed elementwise on the activation's device (int64 arithmetic, no
generator state): element (t, j) of a row is kept when mix(key(row, t) ^ key(layer, j)) >= p * 2^32, with
mix a 32-bit integer finalizer. Position t counts from the row's start, so a row padded wider in another
micro-batch layout keeps its mask on its own tokens. Cost: about ten elementwise int64 passes over the
activation (a few rows at a time, so the temporaries stay bounded), no host round trip.

In eval mode the module is the identity, and so is a no-grad forward in training mode (GRPO's sampling-time
log-probs): dropout regularizes the gradient's forward only. A forward with gradients in training mode
outside `rows` is an error, so that no training path silently loses its dropout."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
CHUNK = 1 << 26  # mask elements computed at once

_keys: torch.Tensor | None = None  # [B] 63-bit keys of the current micro-batch's samples (module-global:
                                   # a CUDA backward, and so a recompute, runs on another thread)
_offset = 0  # the position of the activations' first token in its row (a sequence-parallel slice's start)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) of int64 values in [0, 2^32); the multipliers are
    below 2^31 so that products stay below 2^63: int64 arithmetic is exact, the same on every device."""
    x = ((x >> 16) ^ x) * 0x7FEB352D & M32
    x = ((x >> 15) ^ x) * 0x045D9F3B & M32
    return (x >> 16) ^ x


def sample_keys(seed: int, step: int, samples: torch.Tensor) -> torch.Tensor:
    """[B] int64 keys of the step's samples (by their index in the global batch), on samples' device."""
    s = samples.to(torch.int64)
    base = _mix(_mix(torch.full_like(s, seed & M32) ^ (seed >> 32 & M32)) ^ (step & M32))
    return (_mix(base ^ (s & M32)) << 31) ^ _mix(_mix(base + GOLDEN & M32) ^ (s >> 32 & M32) ^ (s & M32))


@contextlib.contextmanager
def rows(seed: int, step: int, samples: torch.Tensor | None):
    """Keyed dropout masks for the forwards and backward inside the block: those of `samples` (a
    micro-batch's sample indices in the step's global batch) at `step`. samples None: no keys (a training
    forward then refuses to run)."""
    global _keys
    saved, _keys = _keys, None if samples is None else sample_keys(seed, step, samples)
    try:
        yield
    finally:
        _keys = saved


@contextlib.contextmanager
def offset(start: int):
    """Inside the block, activations hold the positions from `start` of their rows (llmtrain.models.ulysses: a
    rank's slice of the sequence), so their masks are those of the same positions of the whole row."""
    global _offset
    saved, _offset = _offset, start
    try:
        yield
    finally:
        _offset = saved


def keep_mask(keys: torch.Tensor, layer: int, shape: torch.Size, p: float, device: torch.device) -> torch.Tensor:
    """[rows, *shape[1:]] bool: True where an element is kept. keys: the micro-batch's [B] sample keys; rows
    come in blocks of B (row r: sample r % B, part r // B). The last dimension is the features, the ones
    between it and the rows are positions (flattened)."""
    n, features = shape[0], shape[-1]
    keys = keys.to(device)
    r = torch.arange(n, device=device)
    row = keys[r % len(keys)] ^ (r // len(keys)) * GOLDEN
    row = _mix(_mix((row & M32) ^ layer) ^ (row >> 32 & M32))
    positions = int(torch.Size(shape[1:-1]).numel())
    t = torch.arange(_offset, _offset + positions, device=device)
    token = _mix(_mix(t[None] ^ row[:, None]) + GOLDEN & M32)                        # [rows, positions]
    feature = _mix(_mix(torch.arange(features, device=device) ^ layer) ^ GOLDEN)   # [features]
    threshold = int(p * 2 ** 32)
    # A few rows at a time: the int64 temporaries stay near CHUNK elements, not 8x the activation's bytes.
    step = max(1, CHUNK // max(positions * features, 1))
    keep = torch.cat([_mix(token[i:i + step, :, None] ^ feature) >= threshold for i in range(0, n, step)])
    return keep.reshape(shape)


class KeyedDropout(nn.Module):
    """nn.Dropout(p) with keyed masks (the module docstring); `layer` tells layers apart (a 32-bit id)."""

    def __init__(self, p: float, layer: int):
        super().__init__()
        self.p, self.layer = p, layer & M32

    def extra_repr(self) -> str:
        return f"p={self.p}, layer={self.layer:#x}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0 or not torch.is_grad_enabled():
            return x
        if _keys is None:
            raise RuntimeError("lora.dropout: a training forward outside llmtrain.train.step.accumulate has no "
                               "row keys for its dropout masks (keyed_dropout.rows); run it there, or in eval mode")
        keep = keep_mask(_keys, self.layer, x.shape, self.p, x.device)
        return x * keep.to(x.dtype) / (1 - self.p)
