"""The one way the tests and the benchmarks start a process: torchrun --standalone (or plain python) from the
repository root, in its own process group, with one thread per process, offline and unbuffered; finished
within a hard limit, after which (or once the process is done) the whole group is killed, so a hung collective
or an orphaned worker never outlives its caller. tests/helpers/procs.py turns a timeout into a failed test,
bench/common.py into a BenchError: this module imports neither pytest nor llmtrain."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from helpers import forkserver

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
_server: forkserver.Server | None = None  # started by the first spawn that can use it
_no_server: list[str] = []  # why the fork server could not start (then every launch starts a fresh process)


class TimedOut(RuntimeError):
    """The process ran past its limit and was killed with its group; carries what it wrote."""

    def __init__(self, cmd: list[str], timeout: float, stdout: str, stderr: str):
        super().__init__(f"timed out after {timeout:.0f}s: {' '.join(cmd)}")
        self.stdout, self.stderr = stdout, stderr or ""


def env(extra: dict | None = None) -> dict:
    """This process's environment with one thread per process (torchrun's own default for several ranks),
    no Hugging Face Hub and unbuffered output; `extra` last."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(extra or {})}


def command(args: list, nproc: int = 1, torchrun: bool | None = None,
            torchrun_args: tuple[str, ...] = ()) -> list[str]:
    """`args` (a script or -m module and its arguments) under torchrun with nproc processes, or plain python.
    torchrun=None: torchrun for several processes or torchrun_args, plain python for one (the same run, as
    tests/test_features.py checks, without the launcher's ~3 s of CPU)."""
    if torchrun is None:
        torchrun = nproc > 1 or bool(torchrun_args)
    if torchrun:
        return [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", *torchrun_args,
                *map(str, args)]
    return [sys.executable, *map(str, args)]


def start(cmd: list, extra_env: dict | None = None, merge_stderr: bool = False) -> subprocess.Popen:
    """Start cmd from the repository root in a new process group (session), text output piped."""
    return subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=env(extra_env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True,
                            start_new_session=True)


def spawn(args: list, nproc: int = 1, torchrun: bool | None = None, torchrun_args: tuple[str, ...] = (),
          extra_env: dict | None = None) -> subprocess.Popen | forkserver.Forked:
    """start(command(...)), except that llmtrain's own entry points (a recipe, `-m llmtrain.X`) launched with
    torchrun=None, no torchrun_args and no extra environment run as children of the fork server
    (helpers/forkserver.py): nproc ranks with torchrun --standalone's variables, without its agent and without
    the imports each process would pay."""
    global _server
    argv = [str(a) for a in args]
    if torchrun is not None or torchrun_args or extra_env or not _ours(argv) or _no_server:
        return start(command(args, nproc, torchrun, torchrun_args), extra_env)
    if _server is not None and not _server.imported_under(env()):  # a test changed this process's environment
        _server.stop()
        _server = None
    if _server is None:
        try:
            _server = forkserver.Server(str(REPO), env())
        except (OSError, RuntimeError) as e:  # e.g. a socket path too long under this TMPDIR: slower, not wrong
            _no_server.append(str(e))
            print(f"warning: tests/helpers/forkserver.py did not start ({e}); launches start fresh processes",
                  file=sys.stderr)
            return start(command(args, nproc, torchrun, torchrun_args), extra_env)
    return _server.start(argv, env(), False, nproc)


def _ours(argv: list[str]) -> bool:
    """`recipes/X.py ...` or `-m llmtrain.X ...`."""
    if argv[:1] == ["-m"]:
        return len(argv) > 1 and argv[1].startswith("llmtrain.")
    return bool(argv) and Path(argv[0]).resolve().parent == REPO / "recipes"


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


def _kill_group(proc: subprocess.Popen | forkserver.Forked) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is empty: nothing left behind
        pass
