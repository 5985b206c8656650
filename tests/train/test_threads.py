"""Thread pinning: a one-process run (python recipes/X.py: no torchrun) computes with one intra-op thread per
process, as torchrun's ranks do (it sets OMP_NUM_THREADS=1 for nproc_per_node > 1), since a CPU run's numbers
depend on the thread count; OMP_NUM_THREADS, when set, is left to decide."""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmtrain import distributed
from llmtrain.config import DistributedConfig


def test_a_one_process_run_computes_on_one_thread_unless_told(monkeypatch):
    for name in ("OMP_NUM_THREADS", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        env = distributed.init(DistributedConfig(device="cpu"))
        dist.destroy_process_group()
        assert env.world_size == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        torch.set_num_threads(2)
        distributed.pin_threads()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
