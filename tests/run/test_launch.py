"""Launches beyond `torchrun --standalone`: torchrun across two nodes (static and c10d rendezvous), `accelerate
launch` (the shipped single- and multi-node configs; its FSDP settings checked against parallel.*). The
"nodes" are processes on 127.0.0.1; every multi-process run must reproduce the 2-process torchrun losses
(two_rank_losses). The pre-flight checks have their own file, test_preflight.py."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from helpers import RECIPE, REPO, TINY
from helpers.procs import BIN, TWO_RANKS, finish, free_port, losses, start
from llmtrain.config import ConfigError, ParallelConfig
from llmtrain.launch import check_accelerate

TOL = 2e-5
ACCELERATE = BIN / "accelerate"
SINGLE_NODE = REPO / "configs" / "accelerate" / "single_node.yaml"
MULTI_NODE = REPO / "configs" / "accelerate" / "multi_node.yaml"


def recipe_args(out: Path, *overrides: str) -> list:
    return [RECIPE, "--config", TINY, f"output_dir={out}", *overrides]


def check_all(procs: list, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Wait for every process (killing all of them on a timeout); fail naming the first non-zero exit."""
    results = [finish(p, timeout) for p in procs]
    for r in results:
        assert r.returncode == 0, f"exit {r.returncode}: {' '.join(r.args)}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return results


# ---- torchrun across two nodes ------------------------------------------------------------------------
@pytest.mark.slow
def test_torchrun_two_nodes_static_and_c10d_match_one_node(two_rank_losses, tmp_path):
    """torchrun --nnodes 2 --nproc_per_node 1 twice over (one per "node"), with static rendezvous
    (--master_addr/--master_port, --node_rank) and with c10d rendezvous; both pairs run at once."""
    static_port, c10d_port = free_port(), free_port()
    static = [["--nnodes", "2", "--node_rank", str(n), "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
               "--master_port", str(static_port)] for n in (0, 1)]
    c10d = [["--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
             "--rdzv_endpoint", f"127.0.0.1:{c10d_port}", "--rdzv_id", f"llmtrain-{uuid.uuid4().hex[:8]}"]] * 2
    procs = [start(["-m", "torch.distributed.run", *a, *recipe_args(tmp_path / kind, *TWO_RANKS)], torchrun=False)
             for kind, pair in (("static", static), ("c10d", c10d)) for a in pair]
    results = check_all(procs)
    for kind in ("static", "c10d"):
        assert losses(tmp_path / kind) == pytest.approx(two_rank_losses, abs=TOL), kind
        assert (tmp_path / kind / "hf" / "config.json").is_file()
    assert any("preflight ok" in r.stdout and "2 ranks" in r.stdout for r in results[:2])


# ---- accelerate launch ----------------------------------------------------------------------------------
def accelerate(*args):
    """`accelerate launch` with CPU processes: ACCELERATE_USE_CPU=1 plus a MULTI_GPU config gives real
    gloo processes (--cpu would start a single one). --config_file always, so no user default config leaks in."""
    return start([ACCELERATE, "launch", *map(str, args)], torchrun=False, env={"ACCELERATE_USE_CPU": "1"})


@pytest.mark.slow
def test_accelerate_single_node_config_matches_torchrun(two_rank_losses, tmp_path):
    (res,) = check_all([accelerate("--config_file", SINGLE_NODE, "--num_processes", "2",
                                   *recipe_args(tmp_path, *TWO_RANKS))])
    assert losses(tmp_path) == pytest.approx(two_rank_losses, abs=TOL)
    assert "launched by accelerate: it asks for nothing beyond starting the processes" in res.stdout
    assert "2 x cpu (gloo) | strategy ddp" in res.stdout


@pytest.mark.slow
def test_accelerate_multi_node_config_with_fsdp_settings(two_rank_losses, tmp_path):
    """The multi-node config on two "machines"; the FSDP2 it asks for is what parallel.* gives, so it runs
    (and logs which parallel.* key gives each setting and which FSDP settings the recipe does not use)."""
    port = free_port()
    procs = [accelerate("--config_file", MULTI_NODE, "--num_machines", "2", "--num_processes", "2",
                        "--machine_rank", str(r), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
                        "--use_fsdp", "--fsdp_version", "2",
                        *recipe_args(tmp_path, "parallel.strategy=fsdp2", "train.micro_batch_size=2"))
             for r in (0, 1)]
    results = check_all(procs)
    assert losses(tmp_path) == pytest.approx(two_rank_losses, abs=TOL)
    out = "".join(r.stdout for r in results)
    assert "accelerate launch settings, given by parallel.*: FSDP version 2" in out
    assert "= parallel.strategy=fsdp2" in out and "FSDP_STATE_DICT_TYPE" not in out  # not set by these flags
    assert "accelerate FSDP settings not used (the recipe fixes them): " in out and "FSDP_MIN_NUM_PARAMS" in out
    assert "strategy fsdp2" in out


@pytest.mark.slow
def test_accelerate_fsdp_settings_that_parallel_does_not_give_stop_the_run(tmp_path):
    out = tmp_path / "run"
    proc = accelerate("--config_file", SINGLE_NODE, "--num_processes", "2", "--use_fsdp", "--fsdp_version", "2",
                      "--fsdp_activation_checkpointing", "true", "--mixed_precision", "bf16",
                      *recipe_args(out, *TWO_RANKS))
    res = finish(proc, 120)
    assert res.returncode != 0
    err = res.stderr
    assert "accelerate launch asks for settings that the parallel.* config does not give" in err, err[-3000:]
    assert "parallel.* governs" in err
    assert "set parallel.strategy=fsdp2 (it is ddp)" in err
    assert "set parallel.activation_checkpointing=true (it is false)" in err
    assert "set parallel.mixed_precision=bf16 (it is fp32)" in err
    assert not out.exists()  # stopped before anything was written


def test_check_accelerate_mapping():
    p = ParallelConfig(strategy="fsdp", sharding_strategy="SHARD_GRAD_OP", mixed_precision="bf16")
    assert check_accelerate(p, {"PATH": "/bin"}) == []  # not launched by accelerate: nothing to check
    assert check_accelerate(p, {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "NO"}) == [
        "launched by accelerate: it asks for nothing beyond starting the processes"]
    fsdp1 = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "2",  # = SHARD_GRAD_OP
             "ACCELERATE_MIXED_PRECISION": "bf16", "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"}
    lines = check_accelerate(p, fsdp1)
    assert "parallel.strategy=fsdp" in lines[0] and "parallel.sharding_strategy=SHARD_GRAD_OP" in lines[0]
    assert "parallel.mixed_precision=bf16" in lines[0] and "FSDP_STATE_DICT_TYPE=FULL_STATE_DICT" in lines[1]
    with pytest.raises(ConfigError) as e:
        check_accelerate(ParallelConfig(strategy="fsdp2"), {**fsdp1, "ACCELERATE_USE_DEEPSPEED": "true",
                                                           "ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"})
    msg = str(e.value)
    for part in ("DeepSpeed", "set parallel.strategy=fsdp (it is fsdp2)",
                 "set parallel.sharding_strategy=SHARD_GRAD_OP (it is FULL_SHARD)",
                 "set parallel.mixed_precision=bf16 (it is fp32)", "set parallel.compile=true (it is false)"):
        assert part in msg, msg
    assert p == ParallelConfig(strategy="fsdp", sharding_strategy="SHARD_GRAD_OP", mixed_precision="bf16")  # unchanged
