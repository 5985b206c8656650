"""The one way the tests and the benchmarks start a process: torchrun --standalone or plain python from a given
directory (the repository root), in its own process group, with one thread per process, offline and unbuffered;
finished within a hard limit, after which (or once the process is done) the whole group is killed, so a hung
collective or an orphaned worker never outlives its caller. tests/helpers/procs.py turns a timeout into a failed
test, bench/common.py into a BenchError; tests/helpers/launcher.py adds the tests' fork server. Imports nothing
of llmtrain."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent  # where torchrun, lm_eval, accelerate are


class TimedOut(RuntimeError):
    """The process ran past its limit and was killed with its group; carries what it wrote."""

    def __init__(self, cmd: list[str], timeout: float, stdout: str, stderr: str):
        super().__init__(f"timed out after {timeout:.0f}s: {' '.join(cmd)}")
        self.stdout, self.stderr = stdout, stderr or ""


def env(extra: dict | None = None) -> dict:
    """This process's environment with one thread per process (torchrun's own default for several ranks; inductor
    compiles in the process rather than in a pool of fresh interpreters, each importing torch), no Hugging Face
    Hub and unbuffered output; `extra` last."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1", **(extra or {})}


def command(args: list, nproc: int = 1, torchrun: bool | None = None,
            torchrun_args: tuple[str, ...] = (), bindir: Path | None = None) -> list[str]:
    """`args` (a script or -m module and its arguments) under torchrun with nproc processes, or plain python.
    torchrun=None: torchrun for several processes or torchrun_args, plain python for one (the same run, as
    tests/train/test_features.py checks, without the launcher's ~3 s of CPU). bindir: another venv's bin
    directory to run them from (a benchmark's baseline venv); this one's by default."""
    if torchrun is None:
        torchrun = nproc > 1 or bool(torchrun_args)
    if torchrun:
        return [str((bindir or BIN) / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", *torchrun_args,
                *map(str, args)]
    return [str(bindir / "python") if bindir else sys.executable, *map(str, args)]


def start(cmd: list, cwd: Path, extra_env: dict | None = None, merge_stderr: bool = False) -> subprocess.Popen:
    """Start cmd from `cwd` in a new process group (session), text output piped."""
    return subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env(extra_env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for proc within `timeout` seconds, then kill its group; raises TimedOut if it had to be killed."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        raise TimedOut(proc.args, timeout, out, err) from None
    _kill_group(proc)  # anything the process left behind in its group
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _kill_group(proc) -> None:
    """Kill proc's process group (a subprocess.Popen, or anything with the pid of a group leader)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is empty: nothing left behind
        pass
