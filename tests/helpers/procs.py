"""Launch real processes (torchrun --standalone, or plain python: helpers/launcher.py over llmtrain/run/launcher.py,
shared with bench/) with a hard timeout that kills the whole process group, so a hung collective fails a test
instead of hanging the suite; and read what a run logged.
Only a test marked slow may launch: `make test-fast` (-m "not slow") must start no process (tests/conftest.py
tells this module which test is running)."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest

from helpers import RECIPE, REPO, TINY, launcher
from llmtrain.run.failures import launcher_children

BIN = launcher.BIN  # where torchrun, lm_eval, accelerate are

TWO_RANKS = ("parallel.strategy=ddp", "train.micro_batch_size=2")  # global batch 4, as in the reference run
# Whether the running test is marked slow (set by tests/conftest.py before its fixtures are set up).
running_slow_test = False


def start(args: list[str], nproc: int = 1, env: dict | None = None, torchrun: bool | None = None,
          torchrun_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """Start `args` (a script and its arguments) under torchrun with nproc processes, or plain python, or as
    children of the fork server (launcher.spawn), in its own process group (so a timeout can kill everything it
    started). torchrun=True for a test of torchrun's own part (its agent, worker_pids); torchrun=False for a fresh
    interpreter (a worker that must not have llmtrain imported, or measures its own process)."""
    if not running_slow_test:
        pytest.fail("this test starts processes: mark it @pytest.mark.slow (make test-fast runs none)")
    return launcher.spawn(args, nproc, torchrun, torchrun_args, env)


def finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    try:
        return launcher.finish(proc, timeout)
    except launcher.TimedOut as e:
        pytest.fail(f"{e}\n--- stdout\n{e.stdout[-3000:]}\n--- stderr\n{e.stderr[-3000:]}")


def launch(args: list[str], nproc: int = 1, timeout: float = 240, env: dict | None = None,
           torchrun: bool | None = None, torchrun_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return finish(start(args, nproc, env, torchrun, torchrun_args), timeout)


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the training processes below a torchrun process."""
    return launcher_children(launcher_pid)


def run_strategies(worker: str, strategies: list[str], out: Path) -> Path:
    """A 2-rank worker written out (its source: `python worker.py STRATEGIES OUT TESTS`), run once for every
    strategy (its start-up is most of its cost); returns `out`, where it wrote its files."""
    script = out / "worker.py"
    script.write_text(worker)
    res = launch([script, ",".join(strategies), out, REPO / "tests"], nproc=2, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    return out


def wait_for_step(output_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> int:
    """Block until metrics.jsonl reports at least `step`; returns the step seen."""
    deadline = time.monotonic() + timeout
    path = output_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"exited early with {proc.returncode}: {proc.stderr.read()[-3000:]}")
        if path.is_file():
            lines = path.read_text().splitlines()
            if lines and json.loads(lines[-1])["step"] >= step:
                return json.loads(lines[-1])["step"]
        time.sleep(0.05)
    pytest.fail(f"no step {step} within {timeout}s")


def start_recipe(output_dir: Path, *overrides: str, nproc: int = 1, config: Path = TINY, torchrun: bool | None = None,
                 torchrun_args: tuple[str, ...] = (), script: Path = RECIPE) -> subprocess.Popen:
    """Start the recipe (or `script`, another entry point taking the recipe's arguments)."""
    return start([script, "--config", config, f"output_dir={output_dir}", *overrides], nproc=nproc,
                 torchrun=torchrun, torchrun_args=torchrun_args)


def finish_recipe(proc: subprocess.Popen, timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess:
    res = finish(proc, timeout)
    if check and res.returncode != 0:
        pytest.fail(f"exit {res.returncode}: {' '.join(res.args)}\n--- stdout\n{res.stdout[-4000:]}\n"
                    f"--- stderr\n{res.stderr[-6000:]}")
    return res


def run_recipe(output_dir: Path, *overrides: str, nproc: int = 1, config: Path = TINY, check: bool = True,
               timeout: float = 240, torchrun: bool | None = None, torchrun_args: tuple[str, ...] = (),
               script: Path = RECIPE) -> subprocess.CompletedProcess:
    proc = start_recipe(output_dir, *overrides, nproc=nproc, config=config, torchrun=torchrun,
                        torchrun_args=torchrun_args, script=script)
    return finish_recipe(proc, timeout, check)


def run_side_by_side(runs: dict, at_once: int) -> dict[object, subprocess.CompletedProcess]:
    """{key: (output_dir, nproc, overrides, script)} -> {key: result}, `at_once` recipe runs at a time: a
    small run spends much of its time starting up rather than computing. Fails on the first failed run."""
    results, running = {}, []
    for key, (output_dir, nproc, overrides, script) in runs.items():
        if len(running) == at_once:
            done, proc = running.pop(0)
            results[done] = finish_recipe(proc)
        running.append((key, start_recipe(output_dir, *overrides, nproc=nproc, script=script)))
    for key, proc in running:
        results[key] = finish_recipe(proc)
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def losses(output_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(output_dir)]


def losses_by_step(output_dir: Path) -> dict[int, float]:
    """The last logged loss of each step (a restarted run logs the steps after its checkpoint again)."""
    return {r["step"]: r["loss"] for r in read_metrics(output_dir) if "loss" in r}  # not eval records


