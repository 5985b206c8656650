"""Process group set-up from torchrun / accelerate / srun+torchrun environments, device and backend
choice, the device mesh, and the few collectives the recipe needs."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

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


def init(section: DistributedConfig) -> DistEnv:
    """Join the process group announced by the launcher, or form a 1-process group without one, so a
    plain `python recipes/finetune.py` runs the very same code path. With distributed.preflight, reaching
    the store and waiting for every rank are bounded by distributed.preflight_timeout_s (PreflightError)."""
    global _store, _peers
    pin_threads()
    rank, world, local_rank = _env_int("RANK", 0), world_size_from_env(), local_rank_from_env()
    device, backend = pick_device(section, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=section.timeout_s)
    if "MASTER_ADDR" in os.environ and "RANK" in os.environ:
        join_timeout = timedelta(seconds=section.preflight_timeout_s) if section.preflight else timeout
        raw = _connect_store(rank, world, join_timeout)
        store = _attempt_store(raw)
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
        _store = store
        if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's children; every local rank has joined by now
            _peers = launcher_children(os.getppid())
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistEnv(rank, world, local_rank, device, backend)


def pin_threads() -> None:
    """One intra-op thread per process unless OMP_NUM_THREADS says otherwise, as torchrun sets it for its ranks
    (nproc_per_node > 1): a CPU run's numbers depend on the thread count (the order of a matmul's sums), so
    `python recipes/X.py`, `torchrun --nproc_per_node=1` and N ranks compute alike on any number of cores."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def _attempt_store(raw: dist.Store) -> dist.Store:
    # torchrun --max-restarts reuses its store: without a per-attempt prefix, restarted gloo ranks
    # read the dead ranks' addresses and fail with "connectFullMesh ... Connection refused".
    return dist.PrefixStore(f"llmtrain/attempt_{_env_int('TORCHELASTIC_RESTART_COUNT', 0)}", raw)


# This run's store once init() has joined it, and {rank: pid} of the training processes on this node (torchrun's
# children): the console's dedup (error_once) and the naming of a dead peer (lost_peer) use them.
_store: dist.Store | None = None
_peers: dict[int, int] = {}


def launcher_children(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the training processes below a launcher process (torchrun's agent), read from /proc."""
    pids = {}
    try:
        tasks = list(Path(f"/proc/{launcher_pid}/task").iterdir())
    except OSError:
        return pids
    for task in tasks:
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            try:
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in env:
                if item.startswith(b"RANK="):
                    pids[int(item[5:])] = int(child)
    return pids


def write_line(line: str) -> None:
    """`line` on stderr, newline-terminated, in one write(): ranks sharing a console never run together."""
    sys.stderr.flush()
    os.write(2, (line.rstrip("\n") + "\n").encode(errors="replace"))


def tell_launcher(line: str) -> None:
    """Hand this rank's error line to torchrun (TORCHELASTIC_ERROR_FILE), whose failure report then shows it
    instead of "To enable traceback see: ..."."""
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        try:
            Path(path).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))
        except OSError:
            pass  # the report then lacks the line; the console has it


def error_once(line: str) -> None:
    """Print `line` on stderr unless another rank of this run already printed the very same line (a config
    error every rank finds alike is printed once; a rank's own differing line is printed). The ranks agree
    through the run's store: torchrun's agent store before the process group exists, the group's after;
    without one (one process, or no torchrun before init) the line is printed."""
    store = _store or _agent_store()
    if store is not None:
        try:
            if store.add("llmtrain/printed/" + hashlib.sha256(line.encode()).hexdigest()[:32], 1) > 1:
                return
        except (RuntimeError, dist.DistError):
            pass
    write_line(line)


def _agent_store() -> dist.Store | None:
    if world_size_from_env() == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    try:
        return _attempt_store(dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                            is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False))
    except (KeyError, ValueError, RuntimeError, dist.DistError):
        return None


_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused",
         "remote process exited", "ncclremoteerror", "socket closed", "timed out waiting", "watchdog caught",
         "timeout(ms)")
_TIMEOUT = re.compile(r"timed out waiting (\d+) ?ms")  # gloo's
_COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
                "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
                "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single",
                "send", "recv", "reduce"}


def _exit_status(pid: int) -> str | None:
    """How a process ended, read from /proc while it is a zombie (not yet reaped by its launcher): 'was killed
    by SIGKILL' / 'exited with code 1'; 'is gone' once reaped; None while it runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "is gone (torchrun's report says how it ended)"
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] != "Z":
        return None
    status = int(fields[49])  # field 52 of proc(5): the wait status
    if status & 0x7F:
        return f"was killed by {signal.Signals(status & 0x7F).name}"
    return f"exited with code {status >> 8}"


def dead_peers() -> dict[int, str]:
    """{rank: how it ended} of this node's other training processes that are no longer running."""
    return {r: how for r, pid in sorted(_peers.items()) if pid != os.getpid() and (how := _exit_status(pid))}


def _repo_path(filename: str) -> str:
    """llmtrain/... or recipes/... of a source file's path."""
    for top in ("/llmtrain/", "/recipes/"):
        if top in filename:
            return filename[filename.rindex(top) + 1:]
    return filename


def lost_peer(e: BaseException, rank: int) -> str | None:
    """The one line for a collective that failed because a peer went away or never answered (gloo's 'Connection
    reset by peer', NCCL's 'remote process exited', a timeout): which rank lost whom, in which collective, called
    where (the first frame of llmtrain or a recipe outside this module's helpers). None for any other error."""
    text = f"{type(e).__name__}: {e}".lower()
    if not (isinstance(e, (RuntimeError, dist.DistError)) and any(k in text for k in _LOST)):
        return None
    dead = dead_peers()
    deadline = time.monotonic() + 2  # a killed peer's sockets close before it turns zombie: on a busy node the
    while not dead and time.monotonic() < deadline:  # reset can arrive first, so give its exit a moment
        time.sleep(0.05)
        dead = dead_peers()
    if dead:
        who = "; ".join(f"rank {r} {how}" for r, how in dead.items())
    elif _peers:
        who = "no rank on this node died: one is stuck (in a reward function, a data loader?) or one on another " \
              "node died or hung"
    else:
        who = "a peer died or hung?"
    frames = traceback.extract_tb(e.__traceback__)
    collective = next((f.name for f in frames if f.name in _COLLECTIVES and "distributed" in f.filename),
                      "a collective")  # the outermost: all_gather_object, not the all_gather inside it
    ours = [f for f in frames if ("/llmtrain/" in f.filename or "/recipes/" in f.filename)
            and "site-packages" not in f.filename]
    site = next((f for f in reversed(ours) if Path(f.filename).resolve() != Path(__file__).resolve()),
                ours[-1] if ours else None)  # the caller of a helper here (gather_objects, all_reduce)
    where = f" in {_repo_path(site.filename)}:{site.lineno} ({site.name}) `{site.line}`" if site else ""
    if waited := _TIMEOUT.search(text):
        verb = f"timed out after {int(waited.group(1)) / 1000:g} s (distributed.timeout_s) waiting for a peer"
    elif "timed out" in text or "timeout" in text:
        verb = "timed out waiting for a peer"
    else:
        verb = "lost its connection to a peer"
    return f"rank {rank} {verb} ({who}) at {collective}{where}"


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
        if first and not dead_peers():  # a peer died: torchrun is stopping the job, not preempting it
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
