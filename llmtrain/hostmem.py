"""Host-memory allocator settings for runs whose tensors live in host RAM (device cpu).

glibc serves an allocation from its heap unless it is at least M_MMAP_THRESHOLD bytes, and by default
that threshold grows to the size of every mmapped block freed, up to 32 MiB. A training step frees
gathered layers, activations and gradients of a few MiB to tens of MiB, so after the first steps all of
them come from the heap, whose freed blocks stay resident and fragment it: measured on bench/lora.py's
100M model (fsdp2, 2 ranks), glibc held 0.7-1.5 GiB free per rank at the end of each step, more than the
live tensors, and peak RSS grew step after step. A fixed threshold sends every tensor of 256 KiB or more
(a 768-wide activation of 256 tokens is 768 KiB) to its own mapping, returned to the OS when freed: the
free heap stayed under 30 MiB and peak RSS fell by 40% (1 MiB still left 0.3 GiB free in the heap)."""

from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD = 256 << 10
ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's own variable: when the user sets it, it governs


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold (which also stops its dynamic growth). Returns whether it was set: not
    when the user set MALLOC_MMAP_THRESHOLD_, nor without glibc."""
    if ENV in os.environ:
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False
