"""The tests' launches: llmtrain/run/launcher.py (shared with bench/), plus the fork servers: a recipe, `-m llmtrain.X`
or a worker script launched with torchrun=None and no extra environment runs as children of helpers/forkserver.py,
without the imports each fresh process would pay; a worker that must run without llmtrain imported (CLEAN_WORKERS)
as a child of a server that imported torch and transformers only (torchrun=False: a fresh interpreter, for a
worker that measures its own process). This module imports no pytest."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

from helpers import forkserver
from llmtrain.run.launcher import BIN, TimedOut, command, env, finish
from llmtrain.run.launcher import start as start_in

__all__ = ["BIN", "TimedOut", "command", "env", "finish", "spawn", "start"]

REPO = Path(__file__).resolve().parents[2]
CLEAN_WORKERS = {REPO / "tests" / "scripts" / "hf_logits.py"}  # loads exports as a user's transformers alone would
_servers: dict[tuple[str, ...], forkserver.Server] = {}  # by what they import, each started by its first spawn
_no_server = False  # one could not start: every launch starts a fresh process


def start(cmd: list, extra_env: dict | None = None, merge_stderr: bool = False) -> subprocess.Popen:
    """Start cmd from the repository root (llmtrain.run.launcher.start)."""
    return start_in(cmd, REPO, extra_env, merge_stderr)


def spawn(args: list, nproc: int = 1, torchrun: bool | None = None, torchrun_args: tuple[str, ...] = (),
          extra_env: dict | None = None) -> subprocess.Popen | forkserver.Forked:
    """start(command(...)), except that llmtrain's entry points (a recipe, `-m llmtrain.X`) and the tests' worker
    scripts launched with torchrun=None, no torchrun_args and no extra environment run as children of the fork server
    (helpers/forkserver.py): nproc ranks with torchrun --standalone's variables, without its agent and without
    the imports each process would pay."""
    argv = [str(a) for a in args]
    server = None
    if torchrun is None and not torchrun_args and not extra_env and _forkable(argv):
        server = _fork_server(forkserver.CLEAN if Path(argv[0]).resolve() in CLEAN_WORKERS else forkserver.PRELOAD)
    if server is None:
        return start(command(args, nproc, torchrun, torchrun_args), extra_env)
    return server.start(argv, env(), nproc)


def _fork_server(preload: tuple[str, ...]) -> forkserver.Server | None:
    """This process's fork server importing `preload`, started anew if a test changed the environment since (what
    its imports read at start-up would be stale); None if it cannot start (launches then start fresh processes:
    slower, not wrong)."""
    global _no_server
    server = _servers.pop(preload, None)
    if server is not None:
        if (death := server.died()) is not None:  # a warning: it reaches pytest's summary, whatever passes
            warnings.warn(f"tests/helpers/forkserver.py's server ended ({death}); starting another", stacklevel=3)
        if death is not None or not server.imported_under(env()):
            server.stop()
            server = None
    if server is None and not _no_server:
        try:
            server = forkserver.Server(str(REPO), env(), preload)
        except (OSError, RuntimeError) as e:
            _no_server = True
            print(f"warning: tests/helpers/forkserver.py did not start ({e}); launches start fresh processes",
                  file=sys.stderr)
    if server is not None:
        _servers[preload] = server
    return server


def _forkable(argv: list[str]) -> bool:
    """`-m llmtrain.X ...` or a Python script (`recipes/X.py ...`, a worker): not another program or module."""
    if argv[:1] == ["-m"]:
        return len(argv) > 1 and argv[1].startswith("llmtrain.")
    return bool(argv) and argv[0].endswith(".py")
