"""The one way the tests and the benchmarks start a process: torchrun --standalone or plain python (or, for the
tests, a child of helpers/forkserver.py: spawn) from the repository root, in its own process group, with one
thread per process, offline and unbuffered; finished within a hard limit, after which (or once the process is
done) the whole group is killed, so a hung collective or an orphaned worker never outlives its caller.
tests/helpers/procs.py turns a timeout into a failed test, bench/common.py into a BenchError: this module
imports neither pytest nor llmtrain."""

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
_no_server = False  # it could not start: every launch starts a fresh process


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
    argv = [str(a) for a in args]
    server = _fork_server() if torchrun is None and not torchrun_args and not extra_env and _ours(argv) else None
    if server is None:
        return start(command(args, nproc, torchrun, torchrun_args), extra_env)
    return server.start(argv, env(), nproc)


def _fork_server() -> forkserver.Server | None:
    """This process's fork server, started anew if a test changed the environment since (what its imports read
    at start-up would be stale); None if it cannot start (launches then start fresh processes: slower, not wrong)."""
    global _server, _no_server
    if _server is not None and not _server.imported_under(env()):
        _server.stop()
        _server = None
    if _server is None and not _no_server:
        try:
            _server = forkserver.Server(str(REPO), env())
        except (OSError, RuntimeError) as e:
            _no_server = True
            print(f"warning: tests/helpers/forkserver.py did not start ({e}); launches start fresh processes",
                  file=sys.stderr)
    return _server


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
