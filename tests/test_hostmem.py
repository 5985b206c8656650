"""hostmem: with glibc's mmap threshold fixed, freed tensors go back to the OS instead of staying in a
heap whose threshold grew (the peak-RSS growth over steps that bench/lora.py measured). Fresh processes:
mallopt is process-wide."""

from __future__ import annotations

from conftest import finish, start

PROBE = """
import sys, torch
from llmtrain import hostmem
fixed = hostmem.fix_mmap_threshold() if sys.argv[1] == "fix" else None
def anon():
    line = next(l for l in open("/proc/self/status") if l.startswith("RssAnon:"))
    return int(line.split()[1]) << 10
torch.ones(8 << 20, dtype=torch.uint8)  # an 8 MiB mapping, freed: glibc's dynamic threshold rises to 8 MiB
before = anon()
kept = [torch.ones(512 << 10) for _ in range(100)]  # 100 x 2 MiB, like a step's gathered layers and activations
del kept[:-1]
print(fixed, (anon() - before) >> 20)
"""


def _retained(mode: str, env: dict | None = None) -> tuple[str, int]:
    out = finish(start(["-c", PROBE, mode], env=env, torchrun=False), timeout=120).stdout.split()
    return out[0], int(out[1])


def test_fixed_mmap_threshold_returns_freed_tensors_to_the_os():
    fixed, retained = _retained("fix")
    default_fixed, default_retained = _retained("default")
    assert fixed == "True" and retained < 16, retained
    assert default_retained > 100, default_retained  # the probe does show glibc's default retention
    user, user_retained = _retained("fix", env={"MALLOC_MMAP_THRESHOLD_": "33554432"})  # the user's setting governs
    assert user == "False" and user_retained > 100, user_retained
