"""Shared helpers: launch real processes (torchrun --standalone) with a hard timeout that kills the
whole process group, so a hung collective fails a test instead of hanging the suite."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "finetune.py"
TINY = REPO / "tests" / "tiny.yaml"
BIN = Path(sys.executable).parent


def launch(args: list[str], nproc: int = 1, timeout: float = 240, env: dict | None = None,
           torchrun: bool = True) -> subprocess.CompletedProcess:
    """Run `args` (a script and its arguments) under torchrun with nproc processes, or plain python."""
    if torchrun:
        cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", *map(str, args)]
    else:
        cmd = [sys.executable, *map(str, args)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                **(env or {})}
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_recipe(output_dir: Path, *overrides: str, nproc: int = 1, config: Path = TINY, check: bool = True,
               timeout: float = 240, torchrun: bool = True) -> subprocess.CompletedProcess:
    res = launch([RECIPE, "--config", config, f"output_dir={output_dir}", *overrides], nproc=nproc,
                 timeout=timeout, torchrun=torchrun)
    if check and res.returncode != 0:
        pytest.fail(f"exit {res.returncode}: {' '.join(res.args)}\n--- stdout\n{res.stdout[-4000:]}\n"
                    f"--- stderr\n{res.stderr[-6000:]}")
    return res


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def losses(output_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(output_dir)]


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> list[float]:
    """Loss curve of the plainest run (one process, no wrapper, micro 4, accum 1): what all others match."""
    out = tmp_path_factory.mktemp("reference")
    run_recipe(out, "parallel.strategy=none")
    ref = losses(out)
    assert len(ref) == 4 and ref[-1] < ref[0], ref
    return ref
