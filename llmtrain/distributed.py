"""Process group set-up from torchrun / accelerate / srun+torchrun environments, device and backend
choice, the device mesh, and the few collectives the recipe needs."""

from __future__ import annotations

import os
import random
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from llmtrain.config import ConfigError, DistributedConfig


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None or value == "" else int(value)


def world_size_from_env() -> int:
    """The world size the launcher announced (1 without a launcher); known before any process group."""
    return _env_int("WORLD_SIZE", 1)


def local_rank_from_env() -> int:
    return _env_int("LOCAL_RANK", 0)


def pick_device(section: DistributedConfig, local_rank: int) -> tuple[torch.device, str]:
    kind = section.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("distributed.device=cuda but no CUDA device is visible; use distributed.device=cpu or auto")
    backend = section.backend
    if backend == "auto":
        backend = "nccl" if kind == "cuda" else "gloo"
    if backend == "nccl" and kind != "cuda":
        raise ConfigError("distributed.backend=nccl needs distributed.device=cuda; use gloo on CPU")
    if kind == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible; "
                              "lower --nproc_per_node")
        return torch.device("cuda", local_rank), backend
    return torch.device("cpu"), backend


def init(section: DistributedConfig) -> DistEnv:
    """Join the process group announced by the launcher, or form a 1-process group without one, so a
    plain `python recipes/finetune.py` runs the very same code path."""
    rank, world, local_rank = _env_int("RANK", 0), world_size_from_env(), local_rank_from_env()
    device, backend = pick_device(section, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=section.timeout_s)
    if "MASTER_ADDR" in os.environ and "RANK" in os.environ:
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
        # torchrun --max-restarts reuses its store: without a per-attempt prefix, restarted gloo ranks
        # read the dead ranks' addresses and fail with "connectFullMesh ... Connection refused".
        attempt = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
        dist.init_process_group(backend, store=dist.PrefixStore(f"llmtrain/attempt_{attempt}", store), rank=rank,
                                world_size=world, timeout=timeout, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistEnv(rank, world, local_rank, device, backend)


def build_mesh(env: DistEnv, replicate: int) -> DeviceMesh:
    """1-D mesh ("shard",) or, for HSDP, 2-D (replicate, shard)."""
    if replicate == 1:
        return init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(env.device.type, (replicate, env.world_size // replicate),
                            mesh_dim_names=("replicate", "shard"))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def all_reduce(value: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce that every rank must call; returns the tensor for chaining."""
    dist.all_reduce(value, op=op)
    return value


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


PREEMPTED_EXIT_CODE = 42  # saved a checkpoint after SIGTERM/SIGUSR1: requeue me


class PreemptionFlag:
    """SIGTERM (torchrun, Kubernetes) and SIGUSR1 (Slurm's --signal before a time limit or preemption)
    only set a flag; the training loop agrees on it across ranks, saves and exits between steps."""

    def __init__(self) -> None:
        self.signal: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal = signum


def any_rank(*flags: bool, device: torch.device) -> list[bool]:
    """Each flag true on at least one rank (one all-reduce for all of them)."""
    t = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def hard_exit(code: int) -> None:
    """Flush and leave without interpreter teardown: with torch._dynamo imported (transformers' Llama
    imports it), 10-20% of multi-rank gloo runs otherwise abort at exit with 'terminate called
    without an active exception', turning a finished run into a failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
