"""The Slurm templates (slurm/*.sh) against a real local Slurm: two logical nodes n1, n2 on this machine.

The cluster comes from tests/slurm/cluster.py (root + apt, else skipped). The templates launch
tests/slurm/echo_rank.py instead of recipes/finetune.py (LLMTRAIN_RECIPE): it reports every rank,
does a gloo all_reduce across the nodes and plays the recipe's part in preemption (SIGUSR1 ->
checkpoint -> PREEMPT_EXIT_CODE), so the launch, signal and requeue plumbing is what is tested.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("llmtrain_slurm_cluster", REPO / "tests" / "slurm" / "cluster.py")
cluster_mod = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cluster_mod  # dataclasses look the module up by name
_spec.loader.exec_module(cluster_mod)
slurm_cluster = cluster_mod.slurm_cluster  # session fixture

STANDIN = "tests/slurm/echo_rank.py"
CPUS = os.cpu_count() or 1
TEMPLATES = [REPO / "slurm" / "multinode.sh", REPO / "slurm" / "single_node.sh"]


# ---- static checks (fast) --------------------------------------------------------------------------------
@pytest.mark.parametrize("script", TEMPLATES, ids=lambda p: p.name)
def test_template_header(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    header = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    opts = " ".join(header)
    # sbatch stops reading #SBATCH lines at the first command
    first_cmd = next(i for i, line in enumerate(text.splitlines()) if line and not line.startswith("#"))
    assert all(text.splitlines().index(h) < first_cmd for h in header)
    for opt in ("--job-name=llmtrain", "--ntasks-per-node=1", "--requeue", "--signal=B:USR1@",
                "--open-mode=append", "--output=logs/%x-%j.out", "--cpus-per-task=", "--time="):
        assert opt in opts, opt
    assert "gpu" not in opts and "gres" not in opts  # GPUs come from the sbatch command line


_FAKE_TRAINER = r"""
import signal, sys, time
from pathlib import Path
out = Path(sys.argv[1]); seen = []
signal.signal(signal.SIGUSR1, lambda *_: seen.append(1))
(out / "ready").write_text("")
deadline = time.time() + 20
while not seen and time.time() < deadline:
    time.sleep(0.01)
time.sleep(0.5)  # any duplicate USR1 would arrive now
(out / "usr1_count").write_text(str(len(seen)))
sys.exit(int(sys.argv[2]) if seen else 0)
"""


def test_preempt_trap_forwards_once(tmp_path):
    """slurm/common.sh without Slurm: USR1 to the shell reaches the launcher once, however often it
    is sent, and the shell exits with PREEMPT_EXIT_CODE (a Slurm job would requeue instead)."""
    (tmp_path / "t.py").write_text(_FAKE_TRAINER)
    script = (f"set -euo pipefail; source {REPO}/slurm/common.sh; "
              f'llmtrain_run_preemptible "{sys.executable}" {tmp_path}/t.py {tmp_path} "$PREEMPT_EXIT_CODE"; '
              "echo finished-normally")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PREEMPT_EXIT_CODE"] = "43"
    p = subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 20
    while not (tmp_path / "ready").exists():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.01)
    for _ in range(3):
        p.send_signal(signal.SIGUSR1)
        time.sleep(0.1)
    out, _ = p.communicate(timeout=20)
    assert p.returncode == 43, out
    assert (tmp_path / "usr1_count").read_text() == "1", out
    assert out.count("SIGUSR1: asking the training processes") == 1, out
    assert "not a Slurm job" in out and "finished-normally" not in out, out


# ---- helpers ---------------------------------------------------------------------------------------------
def _job_env(cluster, **extra) -> dict[str, str]:
    env = cluster.env
    env.update(LLMTRAIN_RECIPE=STANDIN, NPROC_PER_NODE="1")  # repo root: the sbatch submit dir
    # The template's default port (29500 + job id % 10000) would collide between two test sessions
    # on one machine: both clusters number their jobs from 1.
    env["MASTER_PORT"] = str(cluster_mod._free_port())
    env.pop("OMP_NUM_THREADS", None)
    env.update(extra)
    return env


def _submit(cluster, tmp_path, script, *overrides, sbatch_args=(), **env_extra) -> tuple[str, Path]:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("model: stand-in\n")
    out = tmp_path / "job.out"
    job = cluster.sbatch(
        [f"--cpus-per-task={CPUS}", f"--output={out}", *sbatch_args, str(REPO / "slurm" / script),
         str(cfg), f"standin.out={tmp_path}", *overrides],
        cwd=REPO, env=_job_env(cluster, **env_extra),
    )
    return job, out


def _reports(tmp_path, run: int) -> dict[int, dict]:
    return {r["rank"]: r for r in (json.loads(p.read_text()) for p in tmp_path.glob(f"run{run}-rank*.json"))}


def _explain(cluster, out: Path) -> str:
    text = out.read_text(errors="replace") if out.exists() else "<no job output>"
    return f"--- job output\n{text}\n{cluster.log_tail()}"


# ---- cluster ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_node_job(slurm_cluster, tmp_path):
    script = tmp_path / "hello.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=1\n"
        "echo \"batch on $SLURMD_NODENAME\"\n"
        "srun bash -c 'echo \"task $SLURM_PROCID on $SLURMD_NODENAME\"'\n"
    )
    out = tmp_path / "hello.out"
    r = subprocess.run(["sbatch", "--wait", f"--output={out}", str(script)], env=slurm_cluster.env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.stdout, r.stderr, _explain(slurm_cluster, out))
    text = out.read_text()
    assert "batch on n1" in text
    assert {m for m in re.findall(r"task \d on (\w+)", text)} == {"n1", "n2"}, text


# ---- templates -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_multinode_template_allreduce(slurm_cluster, tmp_path):
    job, out = _submit(slurm_cluster, tmp_path, "multinode.sh", "train.lr=1e-4", "data.name=a b")
    info = slurm_cluster.wait_job(job, timeout=90)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, _explain(slurm_cluster, out))
    reports = _reports(tmp_path, 0)
    assert sorted(reports) == [0, 1], _explain(slurm_cluster, out)
    assert {r["node"] for r in reports.values()} == {"n1", "n2"}
    for r in reports.values():
        assert r["world_size"] == 2 and r["local_rank"] == 0 and r["allreduce_sum"] == 3.0
        # config path and overrides pass through untouched (a space inside a value included)
        assert r["config"] == str(tmp_path / "config.yaml")
        assert r["overrides"] == [f"standin.out={tmp_path}", "train.lr=1e-4", "data.name=a b"]
        assert r["omp_num_threads"] == str(CPUS)  # cpus-per-task / NPROC_PER_NODE
    text = out.read_text()
    assert "rendezvous n1:" in text and "node n2 (node rank 1): starting torchrun" in text


@pytest.mark.slow
def test_single_node_template(slurm_cluster, tmp_path):
    job, out = _submit(slurm_cluster, tmp_path, "single_node.sh", NPROC_PER_NODE="2")
    info = slurm_cluster.wait_job(job, timeout=90)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, _explain(slurm_cluster, out))
    reports = _reports(tmp_path, 0)
    assert sorted(reports) == [0, 1], _explain(slurm_cluster, out)
    assert {r["local_rank"] for r in reports.values()} == {0, 1}
    assert all(r["world_size"] == 2 and r["allreduce_sum"] == 3.0 for r in reports.values())
    assert len({r["node"] for r in reports.values()}) == 1
    assert all(r["omp_num_threads"] == str(max(1, CPUS // 2)) for r in reports.values())


@pytest.mark.slow
def test_multinode_template_preempt_requeue(slurm_cluster, tmp_path):
    """USR1 to the batch shell -> ranks checkpoint and exit 42 -> scontrol requeue -> second run completes."""
    job, out = _submit(slurm_cluster, tmp_path, "multinode.sh", "standin.mode=preempt")
    ready = tmp_path / "ready"
    deadline = time.monotonic() + 60
    while not ready.exists():
        info = slurm_cluster.job_info(job)
        assert info.get("JobState") not in cluster_mod.TERMINAL_STATES, (info, _explain(slurm_cluster, out))
        assert time.monotonic() < deadline, ("stand-in never got ready", _explain(slurm_cluster, out))
        time.sleep(0.1)

    # What Slurm does at --signal=B:USR1@120: signal the batch shell only (not its children, not the steps).
    # Twice: a repeated signal must be neither forwarded again nor kill the batch shell.
    for _ in range(2):
        r = subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm_cluster.env,
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        time.sleep(0.3)
    info = slurm_cluster.wait_job(job, timeout=90)
    explain = _explain(slurm_cluster, out)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, explain)
    assert info["Restarts"] == "1", (info, explain)

    # first run: both ranks got the forwarded USR1 exactly once and "checkpointed" with the distinctive code
    for rank in (0, 1):
        rec = json.loads((tmp_path / f"preempted-rank{rank}.json").read_text())
        assert rec["exit_code"] == 42, rec
    # second run (SLURM_RESTART_COUNT=1): both nodes again, same world
    first, second = _reports(tmp_path, 0), _reports(tmp_path, 1)
    assert sorted(first) == sorted(second) == [0, 1], explain
    assert {r["node"] for r in second.values()} == {"n1", "n2"}
    text = out.read_text()  # --open-mode=append keeps both runs in one file
    assert "restart 0:" in text and "restart 1:" in text, explain
    assert text.count("SIGUSR1: asking the training processes") == 1, explain
    assert f"requeueing job {job}" in text, explain
