"""One run per output_dir: a second run exits 2 naming the owner and writes nothing; a lock left by a killed
run (same host: its process is gone; another node: its heartbeat is stale, or an earlier attempt of the same
job) is taken over with a warning. Real processes for the recipe; the staleness rules in-process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers import RECIPE, TINY
from helpers.procs import finish, read_metrics, run_recipe, start, wait_for_step
from llmtrain.run import lock as lock_lib
from llmtrain.run.lock import LOCK_FILE, STALE_S, OutputDirLock


def fake_owner(tmp_path, age: float = 0.0, **fields) -> None:
    owner = {"host": "node-7", "pid": 4242, "started": "2026-01-01T00:00:00+00:00", "job": None, "token": "x",
             **fields}
    path = tmp_path / LOCK_FILE
    path.write_text(json.dumps(owner))
    os.utime(path, (time.time() - age, time.time() - age))


def test_lock_rules(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    first = OutputDirLock(tmp_path)
    assert first.acquire() is None
    owner = json.loads((tmp_path / LOCK_FILE).read_text())
    assert owner["pid"] == os.getpid() and owner["host"] and owner["started"]
    message = OutputDirLock(tmp_path).acquire()  # the same host, a live process: refused
    assert message.startswith(f"output_dir {tmp_path} is in use by another run: host {owner['host']}, pid "
                              f"{os.getpid()}, started {owner['started']}")
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()

    # another node, fresh heartbeat: refused; stale heartbeat: taken over
    fake_owner(tmp_path, age=1)
    assert "host node-7, pid 4242" in OutputDirLock(tmp_path).acquire()
    fake_owner(tmp_path, age=STALE_S + 10)
    assert OutputDirLock(tmp_path).acquire() is None
    err = capsys.readouterr().err
    assert "taking over the lock" in err and f"heartbeat is {STALE_S + 10:.0f} s old" in err
    lock_lib.release()

    # another node, an earlier attempt of this job (requeued): taken over at once
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    fake_owner(tmp_path, age=1, job="torchrun job-1")
    assert OutputDirLock(tmp_path).acquire() is None
    assert "earlier attempt of this job (torchrun job-1)" in capsys.readouterr().err
    lock_lib.release()

    # this host, a process that is gone
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    fake_owner(tmp_path, host=owner["host"], pid=int(dead.stdout))
    assert OutputDirLock(tmp_path).acquire() is None
    assert f"its process {int(dead.stdout)} on this host is gone" in capsys.readouterr().err
    lock_lib.release()
    assert not (tmp_path / LOCK_FILE).exists()


@pytest.mark.slow
def test_second_run_exits_2_touching_nothing_and_a_killed_runs_lock_is_taken_over(tmp_path):
    first = start([RECIPE, "--config", TINY, f"output_dir={tmp_path}", "train.max_steps=100000"], torchrun=False)
    wait_for_step(tmp_path, 2, first)
    config = (tmp_path / "config.yaml").read_text()
    t0 = time.monotonic()
    second = finish(start([RECIPE, "--config", TINY, f"output_dir={tmp_path}", "train.lr=0.5",
                           "parallel.strategy=ddp", "train.micro_batch_size=2"], nproc=2, torchrun=True), timeout=120)
    assert time.monotonic() - t0 < 90
    # Both ranks refuse alike: one console line (torchrun's report repeats it as each rank's cause).
    assert len(re.findall(rf"(?m)^error: output_dir {tmp_path} is in use by another run: host \S+, pid "
                          rf"{first.pid}, started ", second.stderr)) == 1, second.stderr[-3000:]
    assert re.search(r"exitcode\s*:\s*2", second.stderr)
    assert (tmp_path / "config.yaml").read_text() == config  # run 1's, untouched
    steps = [r["step"] for r in read_metrics(tmp_path)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2  # run 1's records only, none lost

    os.killpg(first.pid, signal.SIGKILL)  # no clean-up: the lock stays
    first.communicate()
    assert (tmp_path / LOCK_FILE).is_file()
    res = run_recipe(tmp_path, "train.max_steps=2", timeout=120)  # forked: no imports to pay
    assert f"taking over the lock of output_dir {tmp_path}" in res.stderr
    assert f"its process {first.pid} on this host is gone" in res.stderr
    assert not (tmp_path / LOCK_FILE).exists()  # released at the end
