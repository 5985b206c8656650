"""Pre-flight checks (llmtrain/preflight.py): `python -m llmtrain.preflight` on a healthy 2-rank torchrun, with a
rank missing or unreachable (fails within its timeout, naming what is missing), with an output_dir that is not
one filesystem for all ranks (a private tmpfs for one rank), the recipe with a missing rank, and the report
logic on made-up rank reports. Real processes, real TCPStore and gloo."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from helpers import RECIPE, REPO, TINY
from helpers.procs import finish, free_port, start
from llmtrain.distributed import compact_ranks
from llmtrain.run.preflight import find_problems

MISSING_TIMEOUT = 5  # seconds a lonely rank waits before it gives up


def rank_env(rank: int, world: int, port: int, **extra: str) -> dict:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **extra}


def popen(cmd: list, env: dict) -> subprocess.Popen:
    """Like conftest.start, for a command that is not python or torchrun (own session: finish() can kill it)."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    return subprocess.Popen(list(map(str, cmd)), cwd=REPO, env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def can_unshare_mounts() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


@pytest.mark.slow
def test_preflight_cli_and_recipe(tmp_path):
    """All cases at once (the failing ones mostly wait): a healthy 2-rank torchrun; rank 0 of 2 alone; rank 1
    of 2 with no rank 0; two ranks whose output_dir differs (rank 1 sees a private tmpfs there); the recipe
    as rank 0 of 2 alone."""
    shared = tmp_path / "shared"
    t0 = time.monotonic()
    healthy = start(["-m", "llmtrain.preflight", "--output-dir", shared, "--timeout", "60"], nproc=2)
    alone0 = start(["-m", "llmtrain.preflight", "--timeout", MISSING_TIMEOUT], torchrun=False,
                   env=rank_env(0, 2, free_port()))
    alone1 = start(["-m", "llmtrain.preflight", "--timeout", MISSING_TIMEOUT], torchrun=False,
                   env=rank_env(1, 2, free_port()))
    recipe = start([RECIPE, "--config", TINY, f"output_dir={tmp_path / 'recipe'}", "parallel.strategy=ddp",
                    f"distributed.preflight_timeout_s={MISSING_TIMEOUT}"], torchrun=False,
                   env=rank_env(0, 2, free_port()))
    split = []
    if can_unshare_mounts():
        port, fs = free_port(), tmp_path / "not_shared"
        fs.mkdir()
        args = ["-m", "llmtrain.preflight", "--output-dir", fs, "--timeout", "15"]
        split = [start(args, torchrun=False, env=rank_env(0, 2, port, SLURMD_NODENAME="nodeA")),
                 popen(["unshare", "-m", "--", "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"', fs,
                        sys.executable, *args], rank_env(1, 2, port, SLURMD_NODENAME="nodeB"))]

    res = finish(healthy, 120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "preflight ok" in res.stdout and "2 ranks on 1 node" in res.stdout, res.stdout
    assert "all-reduce ok, output_dir shared, same versions on every rank (python " in res.stdout, res.stdout
    assert not list(shared.glob(".preflight-*"))  # the token file is cleaned up

    for proc, what in ((alone0, "cli"), (recipe, "recipe")):
        res = finish(proc, 120)
        elapsed = time.monotonic() - t0
        assert res.returncode == 1, (what, res.stdout[-2000:], res.stderr[-4000:])
        assert (f"only 1 of 2 ranks joined within {MISSING_TIMEOUT} s (distributed.preflight_timeout_s); "
                "missing: rank 1") in res.stderr, (what, res.stderr[-4000:])
        assert "error: preflight failed: rank 0 on " in res.stderr
        assert elapsed < MISSING_TIMEOUT + 55, elapsed  # start-up on 2 busy cores + the timeout, not 180 s
    assert not (tmp_path / "recipe" / "metrics.jsonl").exists()

    res = finish(alone1, 120)
    assert res.returncode == 1
    assert "error: preflight failed: rank 1 on " in res.stderr and "cannot reach the rendezvous store at 127.0.0.1:" \
        in res.stderr, res.stderr[-4000:]

    if not split:
        pytest.skip("not root or no mount namespaces (unshare -m): the unshared-output_dir case did not run")
    for rank, proc in enumerate(split):
        res = finish(proc, 120)
        assert res.returncode == 1, (rank, res.stdout, res.stderr[-3000:])
        assert (f"output_dir {tmp_path / 'not_shared'} is not one shared filesystem: rank 1 (nodeB) cannot see "
                "the file rank 0 (nodeA) wrote") in res.stderr, res.stderr[-3000:]


def _info(rank: int, node: str, **kw) -> dict:
    info = {"rank": rank, "node": node, "local_rank": rank % 2, "device": "cuda", "backend": "nccl",
            "allreduce": 10.0, "fs": None, "devices": None,
            "versions": {"python": "3.11.7", "torch": "2.13.0", "transformers": "5.24.0", "cuda": "12.8",
                         "llmtrain": "abc"}}
    for key, value in kw.items():
        (info["versions"] if key in info["versions"] else info)[key] = value
    return info


def test_find_problems_names_ranks_and_nodes():
    good = [_info(r, "n1" if r < 2 else "n2") for r in range(4)]
    assert find_problems(good, 10.0, "/shared/out") == []
    bad = [_info(0, "n1"), _info(1, "n1"), _info(2, "n2", torch="2.12.0", fs="cannot read /x: No such file"),
           _info(3, "n2", torch="2.12.0", fs="cannot read /x: No such file", allreduce=7.0,
                 devices="LOCAL_WORLD_SIZE=2 processes on this node but torch.cuda.device_count()=1")]
    problems = find_problems(bad, 10.0, "/shared/out")
    text = "\n".join(problems)
    assert "rank 3 (n2) got 7" in text
    assert "output_dir /shared/out is not one shared filesystem: ranks 2-3 (n2) cannot see the file rank 0 (n1)" in text
    assert "rank 3 on n2: LOCAL_WORLD_SIZE=2 processes on this node but torch.cuda.device_count()=1" in text
    assert "torch version differs across ranks: 2.13.0 on ranks 0-1 (n1); 2.12.0 on ranks 2-3 (n2)" in text
    assert len(problems) == 4, problems
    assert compact_ranks([7, 0, 1, 2, 5, 8]) == "0-2, 5, 7-8"


def test_preflight_config_keys_documented():
    from llmtrain.config import describe

    rows = {key: (default, doc) for key, _, default, doc in describe()}
    assert rows["distributed.preflight"][0] == "True" and rows["distributed.preflight"][1]
    assert rows["distributed.preflight_timeout_s"][1]
