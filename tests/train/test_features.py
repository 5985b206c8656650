"""Each parallelism option trains the same model: options that must not change the math reproduce the
reference losses exactly (fp32); mixed precision stays close; weights loaded from model.path round-trip
and take no more host RAM per rank than the rank's shards plus one unit in flight."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
from pathlib import Path

import pytest
from safetensors.torch import load_file

from helpers import RECIPE, REPO, TINY, forkserver, launcher
from helpers.procs import TWO_RANKS, finish_recipe, launch, losses, run_recipe, start_recipe
from helpers.runs import Run

TOL = 2e-5
# Options that must not change the math, combined where they are independent.
SAME_MATH = {
    "fsdp2_hsdp_activation_checkpointing_no_reshard": (2, [
        "parallel.strategy=fsdp2", "parallel.replicate=2", "parallel.activation_checkpointing=true",
        "parallel.reshard_after_forward=false"]),
    "fsdp_no_shard_activation_checkpointing": (2, [
        "parallel.strategy=fsdp", "parallel.sharding_strategy=NO_SHARD", "parallel.activation_checkpointing=true"]),
    "fsdp_shard_grad_op": (2, ["parallel.strategy=fsdp", "parallel.sharding_strategy=SHARD_GRAD_OP"]),
    "fsdp_hybrid_shard_4_ranks": (4, ["parallel.strategy=fsdp", "parallel.sharding_strategy=HYBRID_SHARD",
                                      "parallel.replicate=2"]),
    "ddp_scale_lr_auto": (2, ["parallel.strategy=auto", "train.scale_lr=true", "train.lr=5e-4"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SAME_MATH))
def test_option_keeps_losses_exact(tmp_path, reference, name):
    nproc, overrides = SAME_MATH[name]
    res = run_recipe(tmp_path, *overrides, f"train.micro_batch_size={4 // nproc}", nproc=nproc)
    assert losses(tmp_path) == pytest.approx(reference, abs=TOL)
    if name == "ddp_scale_lr_auto":
        assert "strategy ddp (auto:" in res.stdout  # a tiny model fits: auto picks DDP and says why


@pytest.mark.slow
def test_a_run_forked_by_the_tests_fork_server_is_a_fresh_process(tmp_path, reference, two_rank_losses):
    """The tests' launches of llmtrain's entry points run as children of helpers/forkserver.py (imports done
    once; several ranks without torchrun's agent): the same losses, bit for bit, as `python recipes/finetune.py`
    in a fresh interpreter (plain python without torchrun: the same run) and as torchrun's 2 ranks (the shared
    reference and 2-rank runs were forked); the same output and exit status for a bad key. All started at once:
    each fresh process spends seconds importing."""
    fresh = launcher.start(launcher.command([RECIPE, "--config", TINY, f"output_dir={tmp_path / 'one'}",
                                             "parallel.strategy=none"]))
    assert isinstance(fresh, launcher.subprocess.Popen)
    two = start_recipe(tmp_path / "two", *TWO_RANKS, nproc=2, torchrun=True)
    other = launcher.spawn(["-c", "raise SystemExit(3)"])  # not llmtrain's: a fresh process
    assert isinstance(other, launcher.subprocess.Popen)
    bad = [(argv, code, launcher.start(launcher.command(argv)), launcher.spawn(argv))
           for argv, code in (([RECIPE, "--config", TINY, "train.lrr=1"], 2),
                              (["-m", "llmtrain.convert", str(tmp_path / "missing"), str(tmp_path / "out")], 2))]
    res = launcher.finish(fresh, 240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert losses(tmp_path / "one") == reference
    finish_recipe(two)
    assert losses(tmp_path / "two") == two_rank_losses
    assert launcher.finish(other, 240).returncode == 3
    for argv, code, started, forked in bad:
        assert isinstance(forked, forkserver.Forked)
        a, b = launcher.finish(started, 240), launcher.finish(forked, 240)
        assert (b.returncode, b.stdout, b.stderr) == (a.returncode, a.stdout, a.stderr)
        assert a.returncode == code, a.stderr


@pytest.mark.slow
def test_a_fork_servers_socket_appears_only_once_it_listens(tmp_path):
    """The client takes the socket path's existence for "ready": here the server's listen() comes a second after
    its bind (a sitecustomize slows it), and the first launch, sent as soon as the path exists, still connects
    (it was refused when the path appeared at bind)."""
    (tmp_path / "sitecustomize.py").write_text(
        "import socket, time\n"
        "listen = socket.socket.listen\n"
        "socket.socket.listen = lambda self, *a: (time.sleep(1), listen(self, *a))[1]\n")
    (tmp_path / "hello.py").write_text("print('hello')\n")
    environ = {**launcher.env(), "PYTHONPATH": str(tmp_path)}
    server = forkserver.Server(str(REPO), environ, preload=())
    try:
        forked = server.start([str(tmp_path / "hello.py")], environ)
        assert forked.communicate(timeout=60) == ("hello\n", "") and forked.returncode == 0
    finally:
        server.stop()


@pytest.mark.slow
def test_the_fork_server_outlives_a_bad_request_and_a_dead_one_is_replaced_with_a_warning(tmp_path):
    """A request the server cannot read fails alone (the server logs it and serves the next); a server that died
    (here: killed) is replaced at the next launch, with a warning that says how it ended (pytest's summary
    shows it even when every test passes)."""
    argv = ["-m", "llmtrain.convert", str(tmp_path / "missing"), str(tmp_path / "out")]  # exits 2, quickly
    assert launcher.finish(launcher.spawn(argv), 240).returncode == 2
    server = launcher._servers[forkserver.PRELOAD]
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(server.path)
        conn.sendall(b"not a request")
    assert launcher.finish(launcher.spawn(argv), 240).returncode == 2
    assert server.died() is None and "JSONDecodeError" in Path(server.path + ".log").read_text()
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    with pytest.warns(UserWarning, match=r"(?s)server ended \(exit status -9; the end of its log:\n.*JSONDecodeError"):
        forked = launcher.spawn(argv)
    assert isinstance(forked, forkserver.Forked) and launcher._servers[forkserver.PRELOAD] is not server
    assert launcher.finish(forked, 240).returncode == 2


@pytest.mark.slow
@pytest.mark.parametrize("strategy,dtype", [("ddp", "fp16"), ("fsdp", "bf16"), ("fsdp2", "bf16")])
def test_mixed_precision_trains_close_to_fp32(tmp_path, reference, strategy, dtype):
    run_recipe(tmp_path, f"parallel.strategy={strategy}", f"parallel.mixed_precision={dtype}",
               "train.micro_batch_size=2", nproc=2)
    assert losses(tmp_path) == pytest.approx(reference, abs=2e-2)


@pytest.mark.slow
def test_weights_from_model_path_round_trip(tmp_path, shared_runs):
    """Train and export under FSDP2, then load that directory through FSDP1 sharding on 2 ranks and
    export again after a step at a negligible lr: the tensors must come back the same. (The FSDP2 run is
    test_parity's 2-rank one, shared.)"""
    first, second = shared_runs(Run(("parallel.strategy=fsdp2", "train.micro_batch_size=2"), nproc=2)), tmp_path
    run_recipe(second, "parallel.strategy=fsdp", "model.config=null", "tokenizer.path=null",
               f"model.path={first / 'hf'}", "train.max_steps=1", "train.lr=1e-12", "train.micro_batch_size=2",
               nproc=2)
    a, b = load_file(first / "hf" / "model.safetensors"), load_file(second / "hf" / "model.safetensors")
    assert a.keys() == b.keys() and "lm_head.weight" not in a  # tied: stored once
    for name in a:
        assert (a[name] - b[name]).abs().max() < 1e-8, name
    assert losses(second)[0] < losses(first)[0]  # it starts from the trained weights, not from scratch


LOAD_SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=12, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=True)
MEMORY_PROBE = REPO / "bench" / "benchmarks" / "memory" / "probe.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> tuple:
    """A 12-layer model on disk (safetensors + the repo's tokenizer) and its weight bytes."""
    path = tmp_path_factory.mktemp("load") / "model"
    exported = launch([MEMORY_PROBE, "--export", path, "--shape", json.dumps(LOAD_SHAPE)], torchrun=False, timeout=120)
    assert exported.returncode == 0, exported.stderr[-2000:]
    for f in (REPO / "assets" / "tokenizer").iterdir():
        shutil.copy(f, path)
    return path, json.loads(exported.stdout.strip().splitlines()[-1])["bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_loading_holds_own_shards_plus_one_unit(tmp_path, model_dir, strategy):
    """4 ranks load the model from model.path (bench/benchmarks/memory/probe.py: the recipe's own loading path).
    Each rank's peak of anonymous memory while parallelizing and loading is its shards plus, at most, the
    largest unit gathered and one tensor read (fsdp; fsdp2 reads slices): not a copy of the model per rank."""
    path, weights = model_dir
    out = tmp_path / "probe.json"
    res = launch([MEMORY_PROBE, "--model", path, "--strategy", strategy, "--seq-len", "16", "--out", out], nproc=4)
    assert res.returncode == 0, res.stderr[-3000:]
    largest_unit = 4 * LOAD_SHAPE["vocab_size"] * LOAD_SHAPE["hidden_size"]  # the embedding, in the root unit
    for rank in json.loads(out.read_text())["ranks"]:
        shard = rank["params_bytes_after_load"]
        assert shard == pytest.approx(weights / 4, rel=0.02)
        assert rank["load_anon_peak_bytes"] < shard + 2 * largest_unit + 8 * 2**20 < 0.7 * weights, rank


def test_auto_picks_fsdp2_when_the_state_does_not_fit():
    import torch

    from llmtrain.config import ParallelConfig
    from llmtrain.parallelize import resolve

    small = resolve(ParallelConfig(strategy="auto"), 1000, 2, torch.device("cpu"))
    huge = resolve(ParallelConfig(strategy="auto"), 10**13, 2, torch.device("cpu"))
    assert (small.strategy.name, huge.strategy.name) == ("ddp", "fsdp2")
    assert "does not fit" in huge.reason and "GiB" in huge.reason
    assert resolve(ParallelConfig(strategy="auto"), 1000, 1, torch.device("cpu")).strategy.name == "none"
