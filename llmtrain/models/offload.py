"""Activation offloading (train.activation_offloading; TRL's `activation_offloading`, torchtune's
`enable_activation_offloading`): the tensors autograd saves during a micro-batch's forward for its backward are
moved to pinned host memory as they are saved and copied back when the backward needs them, through
torch.autograd.graph.saved_tensors_hooks. The copy out runs on a side CUDA stream, so it overlaps the forward's
compute (the device tensor is kept from reuse until it is done: record_stream); the copy back is asynchronous from
pinned memory, ordered after it on the compute stream. What stays on the device: tensors under MIN_BYTES (a copy
costs more than it saves) and parameters (FSDP's gathered weights, a frozen base: they are not activations, and are
there for the backward anyway).

On a CPU run activations are in host memory already: the run says so in one line and installs no hooks. The
numerics are those of the same hooks with the host copy made on the CPU (SavedToHost(device cpu)): the tests
compare losses and gradients bit for bit."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

MIN_BYTES = 1 << 20  # smaller saved tensors stay on the device


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (FSDP1's flat parameter's views)."""
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


class SavedToHost:
    """The pack / unpack pair of saved_tensors_hooks: a saved tensor on `device` of at least min_bytes goes to a
    host copy (pinned on CUDA) and comes back to `device` for the backward. `moved` counts the tensors it moved."""

    def __init__(self, device: torch.device, min_bytes: int = MIN_BYTES):
        self.device, self.min_bytes, self.moved = device, min_bytes, 0
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def pack(self, t: torch.Tensor):
        if (t.device != self.device or t.layout != torch.strided or t.numel() * t.element_size() < self.min_bytes
                or _is_parameter(t)):
            return t
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.cuda)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # t is written
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # the allocator keeps t until the copy is done
            done = self.stream.record_event()
        else:
            host.copy_(t)
            done = None
        self.moved += 1
        return host, done

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        host, done = packed
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        return torch.empty_like(host, device=self.device).copy_(host, non_blocking=self.cuda)  # contiguous

    def hooks(self) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def for_run(enabled: bool, device: torch.device) -> tuple[Callable[[], contextlib.AbstractContextManager], str]:
    """train.activation_offloading for a run on `device`: (the context around each micro-batch's forward, the log
    line saying what it does; "" when off)."""
    if not enabled:
        return contextlib.nullcontext, ""
    if device.type != "cuda":
        return contextlib.nullcontext, (f"train.activation_offloading: a no-op on {device.type} (activations are in "
                                        "host memory already: there is nothing to offload to)")
    saved = SavedToHost(device)
    return saved.hooks, (f"activation offloading: saved activations of {MIN_BYTES >> 20} MiB or more to pinned host "
                         "memory in forward (a side CUDA stream), back in backward")
