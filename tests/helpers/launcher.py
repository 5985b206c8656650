"""The tests' launches: llmtrain/run/launcher.py (shared with bench/), plus the fork server: a recipe or
`-m llmtrain.X` launched with torchrun=None and no extra environment runs as children of helpers/forkserver.py,
without the imports each fresh process would pay. This module imports no pytest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import forkserver
from llmtrain.run.launcher import BIN, TimedOut, command, env, finish
from llmtrain.run.launcher import start as start_in

__all__ = ["BIN", "TimedOut", "command", "env", "finish", "spawn", "start"]

REPO = Path(__file__).resolve().parents[2]
_server: forkserver.Server | None = None  # started by the first spawn that can use it
_no_server = False  # it could not start: every launch starts a fresh process


def start(cmd: list, extra_env: dict | None = None, merge_stderr: bool = False) -> subprocess.Popen:
    """Start cmd from the repository root (llmtrain.run.launcher.start)."""
    return start_in(cmd, REPO, extra_env, merge_stderr)


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
