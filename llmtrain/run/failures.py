"""What a rank says when it or a peer fails: one line, not gloo's or NCCL's raw text. lost_peer names the rank
that went away (read from /proc: torchrun's children, zombies' exit status), the collective and the line of
llmtrain or a recipe that called it; error_once prints a line every rank finds alike once (agreeing through the
run's store); tell_launcher hands the line to torchrun's failure report; write_line keeps ranks sharing a console
from running together. Imports nothing of llmtrain: distributed.init hands it the store (joined)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist


def attempt_store(raw: dist.Store) -> dist.Store:
    """This attempt's view of the rendezvous store: distributed.init joins the process group through it and
    error_once reaches it before there is a group."""
    # torchrun --max-restarts reuses its store: without a per-attempt prefix, restarted gloo ranks
    # read the dead ranks' addresses and fail with "connectFullMesh ... Connection refused".
    return dist.PrefixStore(f"llmtrain/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT') or 0}", raw)


# This run's store once distributed.init() has joined it, and {rank: pid} of the training processes on this node
# (torchrun's children): the console's dedup (error_once) and the naming of a dead peer (lost_peer) use them.
_store: dist.Store | None = None
_peers: dict[int, int] = {}


def joined(store: dist.Store) -> None:
    """Called by distributed.init once this rank is in the process group: the store error_once uses, and under
    torchrun its children, read now that every local rank has started (a dead one is then named by lost_peer)."""
    global _store, _peers
    _store = store
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _peers = launcher_children(os.getppid())


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
    if int(os.environ.get("WORLD_SIZE") or 1) == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    try:
        return attempt_store(dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
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
_COLLECTIVE_HELPERS = Path(__file__).resolve().parents[1] / "distributed.py"  # all_reduce, gather_objects, ...


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
    site = next((f for f in reversed(ours) if Path(f.filename).resolve() != _COLLECTIVE_HELPERS),
                ours[-1] if ours else None)  # the caller of a helper there (gather_objects, all_reduce)
    where = f" in {_repo_path(site.filename)}:{site.lineno} ({site.name}) `{site.line}`" if site else ""
    if waited := _TIMEOUT.search(text):
        verb = f"timed out after {int(waited.group(1)) / 1000:g} s (distributed.timeout_s) waiting for a peer"
    elif "timed out" in text or "timeout" in text:
        verb = "timed out waiting for a peer"
    else:
        verb = "lost its connection to a peer"
    return f"rank {rank} {verb} ({who}) at {collective}{where}"
