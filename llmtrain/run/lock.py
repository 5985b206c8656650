"""One run per output_dir: rank 0 holds output_dir/.llmtrain.lock for the whole run.

The lock file is created with O_CREAT | O_EXCL (atomic on local filesystems and on NFSv3+, Lustre, GPFS) and
names its owner: host, pid, start time, job. While the run lives, a thread refreshes the file's mtime every
HEARTBEAT_S seconds. A second run finds the file and stops (exit 2) naming the owner, unless the lock is
stale, which it then takes over with a warning:
  * on the same host, the owner's process is gone (a SIGKILLed or crashed run);
  * the owner is an earlier attempt of the same job (torchrun --max-restarts, a requeued Slurm job), seen
    from another node;
  * from any node, its heartbeat is older than STALE_S seconds (a dead node)."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import torch.distributed as dist

from llmtrain.config import ConfigError

LOCK_FILE = ".llmtrain.lock"
HEARTBEAT_S = 15.0
STALE_S = 120.0
_HELD: list[OutputDirLock] = []  # the lock this process holds, released by release() when the run ends


def job_id() -> str | None:
    """What stays the same across the attempts of one job: torchrun's run id (restarts), else Slurm's job
    and step (a requeued job keeps them)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run and run != "none":  # "none" is torchrun's default --rdzv-id: not unique to a job
        return f"torchrun {run}"
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm {os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', '')}"
    return None


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (tells a reused pid from the owner), if known."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return started is None or _process_start(pid) in (None, started)


class OutputDirLock:
    def __init__(self, output_dir: str | os.PathLike):
        self.path = Path(output_dir) / LOCK_FILE
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "process_start": _process_start(os.getpid()),
                   "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "job": job_id(),
                   "token": uuid.uuid4().hex}
        self.stop = threading.Event()

    def _raw(self) -> str | None:
        try:
            return self.path.read_text()
        except OSError:
            return None

    def _read(self) -> dict | None:
        try:
            owner = json.loads(self._raw() or "")
            return owner if isinstance(owner, dict) else None
        except ValueError:
            return None

    def stale_reason(self, owner: dict, age: float) -> str | None:
        """Why the lock of `owner` (heartbeat `age` seconds ago) may be taken over; None if it may not."""
        if owner.get("host") == self.me["host"]:
            if _alive(int(owner.get("pid", -1)), owner.get("process_start")):
                return None
            return f"its process {owner.get('pid')} on this host is gone"
        if owner.get("job") and owner.get("job") == self.me["job"]:
            return f"it was left by an earlier attempt of this job ({owner['job']})"
        if age > STALE_S:
            return f"its heartbeat is {age:.0f} s old (more than {STALE_S:.0f} s: its node is gone)"
        return None

    def acquire(self) -> str | None:
        """Take the lock (None), or say who holds it (a one-line message)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(20):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                pass
            else:
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps(self.me))
                threading.Thread(target=self._heartbeat, daemon=True, name="llmtrain-lock").start()
                _HELD.append(self)
                return None
            raw = self._raw()
            try:
                age = time.time() - self.path.stat().st_mtime
            except FileNotFoundError:
                continue  # released meanwhile: try again
            owner = self._read()
            if owner is None:  # being written by its creator this very moment, or garbage
                if age < STALE_S:
                    time.sleep(0.1)
                    continue
                owner = {}
            reason = self.stale_reason(owner, age)
            if reason is None:
                return (f"output_dir {self.path.parent} is in use by another run: host {owner.get('host')}, pid "
                        f"{owner.get('pid')}, started {owner.get('started')} (lock file {self.path}, heartbeat "
                        f"{age:.0f} s ago). Wait for it to end or use another output_dir; if that run is dead "
                        f"(its node too), delete {self.path}")
            if self._take_over(raw):
                print(f"warning: taking over the lock of output_dir {self.path.parent} from host {owner.get('host')}, "
                      f"pid {owner.get('pid')}, started {owner.get('started')}: {reason}", file=sys.stderr,
                      flush=True)
            time.sleep(0.05)
        return f"output_dir {self.path.parent}: could not take the lock {self.path} (other runs keep taking it)"

    def _take_over(self, seen: str | None) -> bool:
        """Remove a stale lock, unless it changed meanwhile. A short-lived O_EXCL guard file keeps two runs
        that both found it stale from removing each other's fresh lock."""
        guard = self.path.with_name(self.path.name + ".takeover")
        try:
            os.close(os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            try:
                if time.time() - guard.stat().st_mtime > 30:  # left by a run that died while taking over
                    guard.unlink()
            except FileNotFoundError:
                pass
            return False
        try:
            if self._raw() != seen:  # taken or released meanwhile
                return False
            self.path.unlink(missing_ok=True)
            return True
        finally:
            guard.unlink(missing_ok=True)

    def _heartbeat(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            if (self._read() or {}).get("token") == self.me["token"]:
                try:
                    os.utime(self.path)
                except OSError:  # a full or flaky filesystem: the next beat tries again
                    pass

    def release(self) -> None:
        self.stop.set()
        if (self._read() or {}).get("token") == self.me["token"]:
            self.path.unlink(missing_ok=True)


def hold(output_dir: str, rank: int) -> None:
    """Collective: rank 0 takes the lock of output_dir before anything is written there; when another run
    holds it, every rank raises ConfigError (exit 2) naming the owner."""
    problem = [None]
    if rank == 0:
        try:
            problem = [OutputDirLock(output_dir).acquire()]
        except OSError as e:
            problem = [f"output_dir: cannot create its lock file in {output_dir}: {e.strerror or e}"]
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise ConfigError(problem[0])


def release() -> None:
    """Release the lock this process holds (a no-op on other ranks)."""
    while _HELD:
        _HELD.pop().release()
