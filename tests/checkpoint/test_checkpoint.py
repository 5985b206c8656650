"""Checkpoints: exact resume (also across world sizes and strategies), atomic publish, async save,
keep_last, the offline converter, and the faults a long run meets (a rank killed, preemption
signals, a full disk, NaN). Real processes, real DCP files."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import RECIPE, TINY
from helpers.procs import (TWO_RANKS, finish, launch, losses, losses_by_step, read_metrics, run_recipe, start,
                           wait_for_step, worker_pids)
from llmtrain.checkpoint import check_writable, complete_checkpoints
from llmtrain.config import ConfigError
from llmtrain.convert import CheckpointError, convert
from llmtrain.convert import main as convert_main

TOL = 2e-5
SIX = ("train.max_steps=6", "checkpoint.every_steps=3")
CONSTANT = ("train.lr_schedule=constant", "train.warmup_steps=0")  # lr independent of max_steps


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory) -> Path:
    """2 ranks, FSDP2, 6 steps, checkpoints (and an HF export) at steps 3 and 6."""
    out = tmp_path_factory.mktemp("fsdp2_run")
    run_recipe(out, "parallel.strategy=fsdp2", "train.micro_batch_size=2", "checkpoint.export_every_steps=3",
               *SIX, nproc=2)
    return out


def resume_from(src: Path, dst: Path, step: int, *overrides: str, nproc: int) -> dict[int, float]:
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / f"step_{step}", dst / "checkpoints" / f"step_{step}")
    res = run_recipe(dst, *overrides, nproc=nproc)
    assert f"resumed at step {step}" in res.stdout
    return losses_by_step(dst)


@pytest.mark.slow
@pytest.mark.parametrize("nproc,strategy", [(1, "none"), (2, "ddp"), (2, "fsdp"), (2, "fsdp2")])
def test_resume_continues_exactly(tmp_path, fsdp2_run, nproc, strategy):
    """From FSDP2 on 2 ranks to each strategy and world size (2 -> 1 included), same global batch."""
    full = losses_by_step(fsdp2_run)
    got = resume_from(fsdp2_run, tmp_path, 3, f"parallel.strategy={strategy}",
                      f"train.micro_batch_size={4 // nproc}", "train.max_steps=6", nproc=nproc)
    assert sorted(got) == [4, 5, 6]
    assert [got[s] for s in (4, 5, 6)] == pytest.approx([full[s] for s in (4, 5, 6)], abs=TOL)


@pytest.mark.slow
def test_resume_from_one_rank_onto_two(tmp_path):
    one = tmp_path / "one"
    run_recipe(one, "parallel.strategy=fsdp", *SIX)
    got = resume_from(one, tmp_path / "two", 3, "parallel.strategy=fsdp2", "train.micro_batch_size=2",
                      "train.max_steps=6", nproc=2)
    full = losses_by_step(one)
    assert [got[s] for s in (4, 5, 6)] == pytest.approx([full[s] for s in (4, 5, 6)], abs=TOL)


@pytest.mark.slow
def test_partial_checkpoints_are_never_loaded(tmp_path, fsdp2_run):
    """A save killed before publishing leaves step_N.tmp; one without its completion marker is
    ignored too: resume=auto takes the newest complete checkpoint."""
    ck = tmp_path / "checkpoints"
    shutil.copytree(fsdp2_run / "checkpoints", ck)
    (ck / "step_6").rename(ck / "step_6.tmp")
    shutil.copytree(ck / "step_3", ck / "step_9")
    (ck / "step_9" / "trainer_state.json").unlink()
    res = run_recipe(tmp_path, "parallel.strategy=fsdp2", "train.micro_batch_size=2", *SIX, nproc=2)
    assert "resumed at step 3" in res.stdout
    full = losses_by_step(fsdp2_run)
    assert [losses_by_step(tmp_path)[s] for s in (4, 5, 6)] == pytest.approx([full[s] for s in (4, 5, 6)], abs=TOL)


@pytest.mark.slow
def test_async_save_and_keep_last(tmp_path, reference):
    run_recipe(tmp_path, "checkpoint.every_steps=1", "checkpoint.async=true", "checkpoint.keep_last=2")
    assert losses(tmp_path) == pytest.approx(reference, abs=TOL)  # saving does not disturb training
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_3", "step_4"]
    state = json.loads((tmp_path / "checkpoints" / "step_4" / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["samples_seen"] == 16
    manifest = json.loads((tmp_path / "checkpoints" / "step_4" / "manifest.json").read_text())["files"]
    assert {n: d["size"] for n, d in manifest.items() if not n.startswith("hf_config")} == {
        p.name: p.stat().st_size for p in (tmp_path / "checkpoints" / "step_4").iterdir()
        if p.is_file() and p.name not in ("manifest.json", "trainer_state.json")}  # the async save's digests too


@pytest.mark.slow
def test_async_checkpoint_resumes_exactly(tmp_path):
    """checkpoint.async=true on 2 ranks (fsdp2, training while the save is written): the save at step 3 records
    step 3 and, resumed in one process, gives steps 4-6 of the uninterrupted run."""
    run_recipe(tmp_path / "async", "checkpoint.async=true", "parallel.strategy=fsdp2", "train.micro_batch_size=2",
               *SIX, nproc=2)
    full = losses_by_step(tmp_path / "async")
    assert sorted(p.name for p in (tmp_path / "async" / "checkpoints").iterdir()) == ["step_3", "step_6"]
    saved = json.loads((tmp_path / "async" / "checkpoints" / "step_3" / "trainer_state.json").read_text())
    assert saved["step"] == 3 and saved["samples_seen"] == 12
    got = resume_from(tmp_path / "async", tmp_path / "resumed", 3, "train.max_steps=6", nproc=1)
    assert sorted(got) == [4, 5, 6]
    assert [got[s] for s in (4, 5, 6)] == pytest.approx([full[s] for s in (4, 5, 6)], abs=TOL)


@pytest.mark.slow
def test_time_based_checkpoints(tmp_path):
    """checkpoint.every_minutes alone: a timer that is always due saves after every step, on 2 ranks that
    agree on it through the per-step all-reduce."""
    run_recipe(tmp_path, "checkpoint.every_minutes=1e-9", "checkpoint.keep_last=0", *TWO_RANKS, nproc=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [f"step_{s}" for s in (1, 2, 3, 4)]


@pytest.mark.slow
def test_resume_of_a_finished_run_only_exports(tmp_path):
    run_recipe(tmp_path, *SIX)
    res = run_recipe(tmp_path, *SIX)
    assert "resumed at step 6" in res.stdout and "exported" in res.stdout
    assert [r for r in losses_by_step(tmp_path)] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_converter_matches_the_export(tmp_path, fsdp2_run):
    """Offline conversion of step_3 gives tensors identical to the export written at step 3, sharded
    when asked, and a bf16 conversion loads in transformers."""
    out = tmp_path / "converted"
    res = launch(["-m", "llmtrain.convert", fsdp2_run / "checkpoints" / "step_3", out, "--max-shard-size", "40KB"],
                 timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "model.safetensors.index.json").is_file()
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1
    converted = {k: v for f in shards for k, v in load_file(f).items()}
    exported = load_file(fsdp2_run / "hf" / "step_3" / "model.safetensors")
    assert converted.keys() == exported.keys()
    for name, tensor in exported.items():
        assert torch.equal(converted[name], tensor), name
    # An existing OUT is replaced only when asked (--overwrite), wholly: no fp32 shard is left beside the bf16 file.
    bf16 = ["-m", "llmtrain.convert", fsdp2_run / "checkpoints" / "step_3", out, "--dtype", "bf16"]
    res = launch(bf16, timeout=120)
    assert res.returncode == 2 and res.stderr.splitlines() == [f"error: {out} exists: pass --overwrite to replace it"]
    assert sorted(out.glob("model-*.safetensors")) == shards
    res = launch([*bf16, "--overwrite"], timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not list(out.glob("model-*.safetensors")) and (out / "model.safetensors").is_file()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.allclose(model.model.embed_tokens.weight.float(), exported["model.embed_tokens.weight"], atol=1e-2)


def test_converting_a_missing_checkpoint_says_it_does_not_exist(tmp_path, capsys):
    assert convert_main([str(tmp_path / "step_9"), str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        f"error: {tmp_path / 'step_9'}: no such checkpoint (they are output_dir/checkpoints/step_<N>)"]
    assert not (tmp_path / "out").exists()


def test_resume_path_must_be_a_complete_checkpoint(tmp_path, run_setup):
    code, _, err = run_setup(RECIPE, "--config", TINY, f"output_dir={tmp_path}", f"checkpoint.resume={tmp_path}")
    assert code == 2
    assert "checkpoint.resume" in err and "not a complete checkpoint" in err


@pytest.mark.slow
def test_killed_rank_ends_the_job_quickly(tmp_path):
    proc = start([RECIPE, "--config", TINY, f"output_dir={tmp_path}", "parallel.strategy=ddp",
                  "train.micro_batch_size=2", "train.max_steps=100000"], nproc=2, torchrun=True)
    wait_for_step(tmp_path, 2, proc)
    killed = time.monotonic()
    os.kill(worker_pids(proc.pid)[1], signal.SIGKILL)
    res = finish(proc, timeout=90)
    assert res.returncode != 0
    assert time.monotonic() - killed < 60


RESTARTABLE = ("parallel.strategy=fsdp2", "train.micro_batch_size=2", *CONSTANT)


@pytest.fixture(scope="module")
def clean_40(tmp_path_factory) -> dict[int, float]:
    """An uninterrupted 40-step run at a constant lr: any prefix of it is the uninterrupted run of
    that length."""
    out = tmp_path_factory.mktemp("clean_40")
    run_recipe(out, *RESTARTABLE, "train.max_steps=40", nproc=2)
    return losses_by_step(out)


@pytest.mark.slow
def test_torchrun_restart_resumes_from_latest_checkpoint(tmp_path, clean_40):
    """With --max-restarts, a rank killed mid-run is restarted and the job finishes with the losses of
    an uninterrupted run."""
    proc = start([RECIPE, "--config", TINY, f"output_dir={tmp_path}", *RESTARTABLE, "train.max_steps=40",
                  "checkpoint.every_steps=2"], nproc=2, torchrun_args=("--max-restarts=1",))
    wait_for_step(tmp_path, 3, proc)
    os.kill(worker_pids(proc.pid)[1], signal.SIGKILL)
    res = finish(proc, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed at step" in res.stdout
    assert losses_by_step(tmp_path) == pytest.approx(clean_40, abs=TOL)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_preemption_signal_saves_and_exits_for_requeue(tmp_path, clean_40, sig):
    """The signal reaches one rank only (the worst case): all ranks agree, save, exit with code 42.
    The requeued run (SIGUSR1 case) resumes and matches the uninterrupted losses."""
    proc = start([RECIPE, "--config", TINY, f"output_dir={tmp_path}", "train.max_steps=100000", *RESTARTABLE],
                 nproc=2, torchrun=True)
    wait_for_step(tmp_path, 2, proc)
    os.kill(worker_pids(proc.pid)[1], sig)
    res = finish(proc, timeout=120)
    assert re.search(r"exitcode\s*:\s*42", res.stderr), res.stderr[-3000:]
    step = complete_checkpoints(tmp_path / "checkpoints")[-1][0]  # by step number: step_10 sorts after step_9
    assert step >= 2
    if sig == signal.SIGUSR1:
        assert step + 3 <= 40
        run_recipe(tmp_path, f"train.max_steps={step + 3}", *RESTARTABLE, nproc=2)
        got = losses_by_step(tmp_path)
        assert got == pytest.approx({s: clean_40[s] for s in got}, abs=TOL)
        assert max(got) == step + 3


def test_unwritable_output_dir_fails_before_training(tmp_path, run_setup):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code, _, err = run_setup(RECIPE, "--config", TINY, f"output_dir={blocker / 'run'}")
    assert code == 2
    assert "output_dir: cannot write" in err
    with pytest.raises(ConfigError, match=f"output_dir: {blocker} is a file, not a directory"):
        check_writable(str(blocker))


@pytest.mark.slow
def test_disk_full_at_save_keeps_the_previous_checkpoint(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1400k", "tmpfs", str(disk)]).returncode:
        pytest.skip("cannot mount tmpfs here")
    try:
        res = run_recipe(disk, "checkpoint.every_steps=2", "checkpoint.keep_last=0", check=False)
        assert res.returncode == 1
        assert f"error: no space left on device in {disk / 'checkpoints'}: saving checkpoint step_4 (about " \
            in res.stderr and "earlier checkpoints are intact (newest: step_2" in res.stderr
        assert (disk / "checkpoints" / "step_2" / "trainer_state.json").is_file()
        assert not (disk / "checkpoints" / "step_4").exists()
    finally:
        subprocess.run(["umount", str(disk)])


@pytest.mark.slow
def test_nan_stops_naming_the_step_or_is_skipped(tmp_path):
    blowup = ("train.lr=1e30", "train.max_grad_norm=0", "checkpoint.every_steps=1")
    res = run_recipe(tmp_path / "stop", *blowup, check=False)
    assert res.returncode == 1
    assert re.search(r"non-finite loss .* at step 2", res.stderr), res.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "stop" / "checkpoints").iterdir()) == ["step_1"]
    run_recipe(tmp_path / "skip", *blowup, "train.on_nan=skip")
    assert [r["skipped_steps"] for r in read_metrics(tmp_path / "skip")] == [0, 1, 2, 3]


def truncate(path: Path, keep: int = 100) -> int:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(keep)
    return size


@pytest.mark.slow
def test_corrupt_checkpoints_are_skipped_kept_and_named(tmp_path, fsdp2_run):
    """The newest checkpoint (step_6) has a truncated shard and a newer step_9 has no .metadata: resume=auto
    warns about each, sets them aside (kept, never pruned), resumes from step_3 and matches the uninterrupted
    losses. An explicit checkpoint.resume to a corrupt checkpoint is an error on every rank."""
    ck = tmp_path / "auto" / "checkpoints"
    shutil.copytree(fsdp2_run / "checkpoints", ck)
    manifest = json.loads((ck / "step_6" / "manifest.json").read_text())["files"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "rng_rank1.json", "config.yaml"} <= manifest.keys()
    size = truncate(ck / "step_6" / "__1_0.distcp")
    shutil.copytree(ck / "step_3", ck / "step_9")
    (ck / "step_9" / ".metadata").unlink()
    explicit = tmp_path / "explicit" / "step_6"
    shutil.copytree(fsdp2_run / "checkpoints" / "step_6", explicit)
    (explicit / "rng_rank0.json").write_text((explicit / "rng_rank0.json").read_text().replace("A", "B", 1))
    two = ("parallel.strategy=fsdp2", "train.micro_batch_size=2", *SIX)
    auto = start([RECIPE, "--config", TINY, f"output_dir={tmp_path / 'auto'}", *two], nproc=2, torchrun=True)
    bad = start([RECIPE, "--config", TINY, f"output_dir={tmp_path / 'other'}", f"checkpoint.resume={explicit}", *two],
                nproc=2, torchrun=True)
    res = finish(bad, timeout=240)
    assert re.search(r"exitcode\s*:\s*2", res.stderr), res.stderr[-3000:]
    refused = f"error: checkpoint.resume: {explicit} fails verification: rng_rank0.json has changed since it was saved"
    assert len([line for line in res.stderr.splitlines() if line.startswith(refused)]) == 1, res.stderr[-3000:]
    res = finish(auto, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed at step 3" in res.stdout
    assert f"skipping checkpoint {ck / 'step_9'}: no .metadata" in res.stderr
    assert (f"skipping checkpoint {ck / 'step_6'}: __1_0.distcp is 100 bytes, {size} when saved (truncated?). "
            f"It is kept as {ck / 'step_6.corrupt'}") in res.stderr
    full = losses_by_step(fsdp2_run)
    assert [losses_by_step(tmp_path / "auto")[s] for s in (4, 5, 6)] == pytest.approx([full[s] for s in (4, 5, 6)],
                                                                                      abs=TOL)
    assert sorted(p.name for p in ck.iterdir()) == ["step_3", "step_6", "step_6.corrupt", "step_9.corrupt"]
    assert (ck / "step_6.corrupt" / "__1_0.distcp").stat().st_size == 100
    with pytest.raises(CheckpointError, match=r"step_6.corrupt fails verification: __1_0.distcp is 100 bytes"):
        convert(ck / "step_6.corrupt", tmp_path / "hf", "fp32", "5GB")  # the offline converter verifies too
