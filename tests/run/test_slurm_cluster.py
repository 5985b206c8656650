"""The Slurm templates (slurm/*.sh) against a real local Slurm: two logical nodes n1, n2 on this machine.

The cluster comes from tests/slurm/cluster.py (root + apt, else skipped). The templates run the real
recipe (recipes/finetune.py on tests/tiny.yaml) for a 2-node training run and for preemption (SIGUSR1 ->
checkpoint -> exit 42 -> requeue -> resume), and tests/slurm/echo_rank.py (LLMTRAIN_RECIPE), which only
reports what every rank was handed, for the cheaper checks of the launch plumbing.
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
import yaml

from helpers import RECIPE, TINY
from helpers.procs import TWO_RANKS, finish, losses, losses_by_step, start
from llmtrain.checkpoint import complete_checkpoints
from llmtrain.distributed import PREEMPTED_EXIT_CODE

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("llmtrain_slurm_cluster", REPO / "tests" / "slurm" / "cluster.py")
cluster_mod = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cluster_mod  # dataclasses look the module up by name
_spec.loader.exec_module(cluster_mod)
slurm_cluster = cluster_mod.slurm_cluster  # session fixture

STANDIN = "tests/slurm/echo_rank.py"
TOL = 2e-5
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
    is sent, and the shell exits with the recipe's preemption code (a Slurm job would requeue instead),
    whatever the launcher exits with (torchrun: 1)."""
    (tmp_path / "t.py").write_text(_FAKE_TRAINER)
    script = (f"set -euo pipefail; source {REPO}/slurm/common.sh; "
              f'llmtrain_run_preemptible "{sys.executable}" {tmp_path}/t.py {tmp_path} 1; '
              "echo finished-normally")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    p = subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 20
    while not (tmp_path / "ready").exists():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.01)
    for _ in range(3):
        p.send_signal(signal.SIGUSR1)
        time.sleep(0.1)
    out, _ = p.communicate(timeout=20)
    assert p.returncode == PREEMPTED_EXIT_CODE, out
    assert (tmp_path / "usr1_count").read_text() == "1", out
    assert out.count("SIGUSR1: asking the training processes") == 1, out
    assert "not a Slurm job" in out and "finished-normally" not in out, out


def test_preempt_exit_code_is_the_recipes():
    r = subprocess.run(["bash", "-c", f"source {REPO}/slurm/common.sh; echo $PREEMPT_EXIT_CODE"],
                       capture_output=True, text=True, check=True)
    assert r.stdout.strip() == str(PREEMPTED_EXIT_CODE) == "42"


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


def _recipe_env(cluster) -> dict[str, str]:
    """The real recipe, one process per node, one thread each (as the torchrun runs it is compared with)."""
    return _job_env(cluster, LLMTRAIN_RECIPE="recipes/finetune.py", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


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
def test_multinode_template_trains_with_the_recipe(slurm_cluster, two_rank_losses, tmp_path):
    """`sbatch slurm/multinode.sh tests/tiny.yaml ...`: 2 nodes x 1 process run recipes/finetune.py and
    reproduce the losses of the same run under torchrun on one node; the HF export is there. (Polled here
    rather than `sbatch --wait`, which checks the job at 2, 10, 42 s: up to 20 s lost per test.)"""
    out, log = tmp_path / "run", tmp_path / "job.out"
    job = slurm_cluster.sbatch([f"--cpus-per-task={CPUS}", f"--output={log}", str(REPO / "slurm" / "multinode.sh"),
                                str(TINY), f"output_dir={out}", *TWO_RANKS], cwd=REPO, env=_recipe_env(slurm_cluster))
    info = slurm_cluster.wait_job(job, timeout=240)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, _explain(slurm_cluster, log))
    assert losses(out) == pytest.approx(two_rank_losses, abs=TOL), _explain(slurm_cluster, log)
    assert (out / "hf" / "config.json").is_file() and (out / "hf" / "model.safetensors").is_file()
    text = log.read_text()
    # the recipe's preflight saw both Slurm nodes (RANK 0 may be on either: c10d ranks in arrival order)
    assert re.search(r"preflight ok .*: 2 ranks on 2 nodes \((n1|n2): \d; (n1|n2): \d\)", text), text
    assert "node n2 (node rank 1): starting torchrun" in text


def _wait_until(what: str, check, cluster, job: str, log: Path, timeout: float = 120):
    """Poll check() until it returns something truthy, failing early if the job ends."""
    deadline = time.monotonic() + timeout
    while not (found := check()):
        info = cluster.job_info(job)
        assert info.get("JobState") not in cluster_mod.TERMINAL_STATES, (what, info, _explain(cluster, log))
        assert time.monotonic() < deadline, (f"no {what} within {timeout}s", _explain(cluster, log))
        time.sleep(0.05)
    return found


@pytest.mark.slow
def test_multinode_template_preempt_requeue_resume(slurm_cluster, tmp_path):
    """USR1 to the batch shell mid-run (twice: forwarded once) -> both ranks of the real recipe save a
    checkpoint and exit 42 -> scontrol requeue -> the requeued job resumes from that checkpoint and
    finishes with the losses of an uninterrupted run."""
    common = (*TWO_RANKS, "train.lr_schedule=constant", "train.warmup_steps=0", "checkpoint.every_steps=0")
    # max_steps lives in the config file, not in the (fixed) job arguments: huge for the signalled run,
    # then set to just past its checkpoint before the requeued run starts (Slurm holds it >= 5 s).
    cfg, config = tmp_path / "config.yaml", yaml.safe_load(TINY.read_text())
    config["train"]["max_steps"] = 100_000
    cfg.write_text(yaml.safe_dump(config))
    out, log = tmp_path / "run", tmp_path / "job.out"
    job = slurm_cluster.sbatch([f"--cpus-per-task={CPUS}", f"--output={log}", str(REPO / "slurm" / "multinode.sh"),
                                str(cfg), f"output_dir={out}", *common], cwd=REPO, env=_recipe_env(slurm_cluster))

    def trained_two_steps():
        try:
            lines = (out / "metrics.jsonl").read_text().splitlines()
            return any(json.loads(line).get("step", 0) >= 2 for line in lines)
        except (OSError, ValueError):  # not there yet, or a line half written
            return False

    _wait_until("step 2", trained_two_steps, slurm_cluster, job, log)
    # What Slurm does at --signal=B:USR1@120: signal the batch shell only. Twice: a repeated signal must
    # be neither forwarded again nor kill the batch shell.
    for _ in range(2):
        r = subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm_cluster.env,
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        time.sleep(0.3)
    # a complete checkpoint: the preempted run is over (the requeued one may not have started yet)
    step = _wait_until("preemption checkpoint", lambda: complete_checkpoints(out / "checkpoints"), slurm_cluster,
                       job, log)[-1][0]
    target = step + 2
    config["train"]["max_steps"] = target
    cfg.write_text(yaml.safe_dump(config))
    clean = start([RECIPE, "--config", TINY, f"output_dir={tmp_path / 'clean'}", f"train.max_steps={target}",
                   *common], nproc=2)  # the uninterrupted run, meanwhile
    info = slurm_cluster.wait_job(job, timeout=180)
    res = finish(clean, 240)
    explain = _explain(slurm_cluster, log)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, explain)
    assert info["Restarts"] == "1", (info, explain)

    text = log.read_text()  # --open-mode=append keeps both runs in one file
    assert "restart 0:" in text and "restart 1:" in text, explain
    assert text.count("SIGUSR1: asking the training processes") == 1, explain
    assert f"preempted: checkpoint step_{step} saved; exiting with code {PREEMPTED_EXIT_CODE}" in text, explain
    assert f"requeueing job {job}" in text and f"resumed at step {step}" in text, explain
    resumed, uninterrupted = losses_by_step(out), losses_by_step(tmp_path / "clean")
    assert sorted(resumed) == list(range(1, target + 1)), explain
    assert resumed == pytest.approx(uninterrupted, abs=TOL)
    assert (out / "hf" / "model.safetensors").is_file()
