"""Process group set-up from torchrun / accelerate / srun+torchrun environments, device and backend
choice, the device mesh, and the few collectives the recipe needs."""

from __future__ import annotations

import os
import random
import signal
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from llmtrain.config import ConfigError, DistributedConfig
from llmtrain.run import failures


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    sp_size: int = 1  # parallel.sp_size: ranks rank // sp_size * sp_size + [0, sp_size) split the same rows
    sp_group: dist.ProcessGroup | None = None  # this rank's sequence group (None at sp_size 1)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        """Data-parallel groups: the ranks that take different rows (the data's world)."""
        return self.world_size // self.sp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp_size


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None or value == "" else int(value)


def world_size_from_env() -> int:
    """The world size the launcher announced (1 without a launcher); known before any process group."""
    return _env_int("WORLD_SIZE", 1)


def local_rank_from_env() -> int:
    return _env_int("LOCAL_RANK", 0)


def device_kind(section: DistributedConfig) -> str:
    """distributed.device resolved: "cuda" or "cpu" (auto: CUDA when a device is visible)."""
    if section.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return section.device


def pick_device(section: DistributedConfig, local_rank: int) -> tuple[torch.device, str]:
    kind = device_kind(section)
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


class PreflightError(RuntimeError):
    """A rank cannot take part in the run; the message names the rank, its node and what is missing."""


def node_name() -> str:
    """Slurm's name of this node when under Slurm (what sinfo/squeue show), else the hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def compact_ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out, ranks = [], sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


def _connect_store(rank: int, world: int, timeout: timedelta) -> dist.TCPStore:
    """The rendezvous store: torchrun's agent store, else one that rank 0 hosts at MASTER_ADDR:MASTER_PORT.
    Unlike dist.rendezvous, rank 0 does not wait here for the others (wait_for_ranks does, naming them)."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    host = rank == 0 and not agent
    # A client retries its connection a few times, each try up to the store's timeout: a third of ours.
    connect = timeout if host else timedelta(seconds=max(1.0, timeout.total_seconds() / 3))
    try:
        store = dist.TCPStore(addr, port, world_size=world, is_master=host, timeout=connect,
                              wait_for_workers=False, multi_tenant=host)
        store.set_timeout(timeout)
        return store
    except (RuntimeError, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = f"rank {rank} on {node_name()}"
        if host:
            raise PreflightError(f"{where}: cannot host the rendezvous store on {addr}:{port} (MASTER_ADDR/"
                                 f"MASTER_PORT; port taken or address not on this host?): {first}") from None
        owner = "torchrun's agent on the first node" if agent else "rank 0"
        raise PreflightError(f"{where}: cannot reach the rendezvous store at {addr}:{port} within "
                             f"{timeout.total_seconds():.0f} s: {owner} is not running or not reachable there "
                             "(wrong MASTER_ADDR/MASTER_PORT, a firewall, or that process never started): "
                             f"{first}") from None


def wait_for_ranks(store: dist.Store, rank: int, world: int, timeout: timedelta) -> None:
    """Every rank announces itself in the store and waits until all `world` ranks have: a missing rank
    fails here, within `timeout`, naming who is missing, instead of hanging in process-group creation."""
    store.set(f"preflight/joined/{rank}", node_name())
    if store.add("preflight/joined", 1) == world:
        store.set("preflight/all_joined", "1")
    try:
        store.wait(["preflight/all_joined"], timeout)
        return
    except (RuntimeError, dist.DistError):
        pass
    where = f"rank {rank} on {node_name()}"
    hint = (". Check that every node launched its processes (--nnodes, --nproc_per_node, WORLD_SIZE) and that "
            "none crashed at start-up (their logs); raise distributed.preflight_timeout_s if start-up is just slow")
    try:
        joined = store.add("preflight/joined", 0)
        msg = (f"{where}: only {joined} of {world} ranks joined within {timeout.total_seconds():.0f} s "
               "(distributed.preflight_timeout_s)")
        if rank == 0 or world <= 64:  # the listing costs one store request per rank
            missing = [r for r in range(world) if not store.check([f"preflight/joined/{r}"])]
            msg += f"; missing: rank{'s' if len(missing) > 1 else ''} {compact_ranks(missing)}"
    except (RuntimeError, dist.DistError):  # the store's host gave up first (it has the same timeout)
        msg = (f"{where}: not all {world} ranks joined, and the rendezvous store went away while waiting "
               "(its host, rank 0 or torchrun's agent, gave up first: its log names the missing ranks)")
    raise PreflightError(msg + hint) from None


def init(section: DistributedConfig, sp_size: int = 1) -> DistEnv:
    """Join the process group announced by the launcher, or form a 1-process group without one, so a
    plain `python recipes/finetune.py` runs the very same code path. With distributed.preflight, reaching
    the store and waiting for every rank are bounded by distributed.preflight_timeout_s (PreflightError).
    sp_size > 1: consecutive ranks form sequence groups (llmtrain.models.ulysses)."""
    pin_threads()
    rank, world, local_rank = _env_int("RANK", 0), world_size_from_env(), local_rank_from_env()
    device, backend = pick_device(section, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=section.timeout_s)
    if "MASTER_ADDR" in os.environ and "RANK" in os.environ:
        join_timeout = timedelta(seconds=section.preflight_timeout_s) if section.preflight else timeout
        raw = _connect_store(rank, world, join_timeout)
        store = failures.attempt_store(raw)
        if section.preflight:
            wait_for_ranks(store, rank, world, join_timeout)
        try:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                    device_id=device if device.type == "cuda" else None)
        except (RuntimeError, dist.DistError) as e:
            if not section.preflight:
                raise
            raise PreflightError(f"rank {rank} on {node_name()}: all {world} ranks joined, but forming the "
                                 f"{backend} process group failed: {str(e).strip()[:2000]}") from None
        raw.set_timeout(timeout)  # later store users (sub-groups, barriers) get the run's timeout
        failures.joined(store)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistEnv(rank, world, local_rank, device, backend, sp_size, sequence_group(rank, world, sp_size))


def sequence_group(rank: int, world: int, sp_size: int) -> dist.ProcessGroup | None:
    """Collective (every rank creates every group): this rank's group of sp_size consecutive ranks. FSDP and DDP
    still reduce gradients over the whole world: a sequence group's ranks each hold part of a row's gradient,
    and the sum over all ranks is the step's gradient (llmtrain.train.step)."""
    if sp_size == 1:
        return None
    mine = None
    for first in range(0, world, sp_size):
        group = dist.new_group(list(range(first, first + sp_size)))
        if first <= rank < first + sp_size:
            mine = group
    return mine


def pin_threads() -> None:
    """One intra-op thread per process unless OMP_NUM_THREADS says otherwise, as torchrun sets it for its ranks
    (nproc_per_node > 1): a CPU run's numbers depend on the thread count (the order of a matmul's sums), so
    `python recipes/X.py`, `torchrun --nproc_per_node=1` and N ranks compute alike on any number of cores."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


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


def gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Every rank's equal-sized rows of `t`, in rank order (an all-gather every rank must call)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def gather_objects(obj) -> list:
    """Every rank's picklable `obj`, in rank order (an all-gather every rank must call)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


PREEMPTED_EXIT_CODE = 42  # saved a checkpoint after SIGTERM/SIGUSR1: requeue me


def shutdown_grace() -> tuple[float, str] | None:
    """How long torchrun lets its workers finish after forwarding a signal before it SIGKILLs them, and where
    that comes from: its --shutdown-timeout flag (read from its command line), else TORCH_ELASTIC_SHUTDOWN_TIMEOUT
    (or PET_SHUTDOWN_TIMEOUT), else torchrun's default of 30 s. None without torchrun: whoever sent the signal
    decides."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    try:
        args = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        args = []
    for i, arg in enumerate(args):
        for flag in ("--shutdown-timeout", "--shutdown_timeout"):
            value = arg[len(flag) + 1:] if arg.startswith(flag + "=") else \
                args[i + 1] if arg == flag and i + 1 < len(args) else None
            if value:
                return float(value), f"torchrun {flag}"
    for name in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        if os.environ.get(name):
            return float(os.environ[name]), name
    return 30.0, "torchrun's default; raise it with TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


class PreemptionFlag:
    """SIGTERM (torchrun, Kubernetes) and SIGUSR1 (Slurm's --signal before a time limit or preemption)
    only set a flag; the training loop agrees on it across ranks, saves and exits between steps. The rank
    that gets the signal says at once what it will do and what is lost if the grace period ends first
    (the loop keeps `step`, `saved_step` and `step_s` current)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.step = 0                     # the step being trained
        self.saved_step: int | None = None  # the newest checkpoint's step
        self.step_s: float | None = None  # how long the last step took
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        first, self.signal = self.signal is None, signum
        if first and not failures.dead_peers():  # a peer died: torchrun is stopping the job, not preempting it
            line = preemption_line(signal.Signals(signum).name, _env_int("RANK", 0), self.step, self.saved_step,
                                   self.step_s, shutdown_grace())
            os.write(2, (line + "\n").encode())  # no flush of sys.stderr here: it may be mid-write


def preemption_line(name: str, rank: int, step: int, saved_step: int | None, step_s: float | None,
                    grace: tuple[float, str] | None) -> str:
    """What a rank says when a preemption signal reaches it during step `step` + 1 (see PreemptionFlag)."""
    saved = f"step {saved_step}" if saved_step is not None else "none yet"
    line = (f"preemption signal {name} (rank {rank}): finishing step {step + 1}, then saving; steps since the last "
            f"checkpoint ({saved}) are lost if ")
    if grace is None:
        return line + "this process is killed before that"
    line += f"the grace period ({grace[0]:g} s, {grace[1]}) ends first"
    if step_s is not None and step_s > grace[0]:
        line += (f"; a step took {step_s:.0f} s, longer than the grace period: this step will not finish and "
                 f"{step + 1 - (saved_step or 0)} steps are lost")
    return line


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
