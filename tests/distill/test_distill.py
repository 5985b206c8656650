"""recipes/distill.py with the tiny reference run's export as teacher and a smaller inline student (same
tokenizer): step 1's loss and its KD / CE parts equal the formulas computed in transformers on the same
weights and batch; a student equal to its teacher has KD 0; the same losses and eval metrics for none / ddp /
fsdp / fsdp2, 1 or 2 ranks, micro-batches or accumulation; exact resume on another world size and strategy;
bad inputs are one line, exit 2, before any process group. The offline teacher (distill.teacher_logits): its
top-k log-probs precomputed by 2 ranks give the online teacher's losses step by step (1 rank none, 2 ranks
fsdp2 with accumulation) without loading it, and resume exactly onto another world size; eval logs the
student's val_loss only; a store that is not the run's (missing, incomplete, other data, another tokenizer,
top_k or temperature, a damaged shard) is one line, exit 2, before any process group."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import REPO, TINY
from helpers.distill import DISTILL, distill_args, reference_kd, seeded_student
from helpers.procs import (finish_recipe, launch, losses_by_step, read_metrics, run_recipe, run_side_by_side,
                           start_recipe)
from llmtrain import data
from llmtrain.recipes.distill import teacher as stored
from llmtrain.config import DataConfig
from llmtrain.models.hf import load_tokenizer
from llmtrain.run.resume import data_fingerprint

VAL = REPO / "data" / "demo" / "val.jsonl"
TOL = 2e-5


@pytest.fixture(scope="session")
def distill_runs(tmp_path_factory, base) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("distill")
    # 10 held-out rows, all evaluated (eval.max_batches caps each rank's batches: 1 and 2 ranks would differ)
    val = root / "val.jsonl"
    val.write_text("".join(VAL.read_text().splitlines(keepends=True)[:10]))
    evals = (f"data.val_path={val}", "eval.every_steps=4")
    runs = {  # name: (ranks, overrides); global batch 4 rows in each
        "none": (1, ("parallel.strategy=none", "checkpoint.every_steps=2", *evals)),
        "ddp": (2, ("parallel.strategy=ddp", "train.micro_batch_size=2")),
        "fsdp": (2, ("parallel.strategy=fsdp", "train.micro_batch_size=2")),
        "fsdp2": (2, ("parallel.strategy=fsdp2", "train.micro_batch_size=1", "train.grad_accum_steps=2", *evals)),
    }
    results = run_side_by_side({name: (root / name, ranks, distill_args(base, *extra), DISTILL)
                                for name, (ranks, extra) in runs.items()}, at_once=2)
    for name, res in results.items():
        (root / name / "stdout.log").write_text(res.stdout)
    return {name: root / name for name in runs}


@pytest.mark.slow
def test_distill_step_one_equals_the_formulas(distill_runs, base):
    """The student's seeded init (hf._random_init: seed 7, its exported config) and the teacher on step 1's
    batch in transformers: the logged loss, kd_loss and ce_loss."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(str(REPO / "assets" / "tokenizer"), False)
    built = data.build(DataConfig(path=str(VAL), seq_len=64, packing=False), tokenizer, seed=7)
    (batch,) = next(data.make_steps(built, 4, 1, 1, 0, 7, torch.device("cpu"), {}))
    student = seeded_student(distill_runs["none"] / "hf")
    teacher = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    targets = batch["labels"][:, 1:]
    keep = targets != -100
    with torch.no_grad():
        logits = [m(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[:, :-1][keep].float()
                  for m in (student, teacher)]
    kd = reference_kd(*logits, len(tokenizer), 0.3, 1.5, 8).mean().item()
    ce = F.cross_entropy(logits[0], targets[keep]).item()
    got = read_metrics(distill_runs["none"])[0]
    assert got["kd_loss"] == pytest.approx(kd, rel=1e-5) and got["ce_loss"] == pytest.approx(ce, rel=1e-5)
    assert got["loss"] == pytest.approx(0.7 * kd + 0.3 * ce, rel=1e-5)


@pytest.mark.slow
def test_distill_losses_match_across_strategies_ranks_and_accumulation(distill_runs):
    want = losses_by_step(distill_runs["none"])
    assert len(want) == 4 and want[4] < want[1], want
    for name in ("ddp", "fsdp", "fsdp2"):
        got = losses_by_step(distill_runs[name])
        assert got == pytest.approx(want, abs=TOL), name
    evals = [[r for r in read_metrics(distill_runs[n]) if "val_loss" in r][0] for n in ("none", "fsdp2")]
    for key in ("val_loss", "val_kd_loss", "val_teacher_loss"):
        assert evals[1][key] == pytest.approx(evals[0][key], abs=TOL), key
    assert evals[0]["val_teacher_loss"] < evals[0]["val_loss"]  # the trained teacher against a fresh student


@pytest.mark.slow
def test_distill_resumes_exactly_on_another_world_size(tmp_path, distill_runs, base):
    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(distill_runs["none"] / "checkpoints" / "step_2", out / "checkpoints" / "step_2")
    res = run_recipe(out, *distill_args(base, "parallel.strategy=fsdp2", "train.micro_batch_size=2"), nproc=2,
                     script=DISTILL)
    assert "resumed at step 2" in res.stdout
    got, want = losses_by_step(out), losses_by_step(distill_runs["none"])
    assert [got[s] for s in (3, 4)] == pytest.approx([want[s] for s in (3, 4)], abs=TOL)


@pytest.mark.slow
def test_distill_student_equal_to_teacher_has_no_kd(tmp_path, base):
    res = run_recipe(tmp_path / "same", "model.config=null", f"model.path={base}", f"distill.teacher_path={base}",
                     "train.max_steps=1", "distill.top_k=8", script=DISTILL)
    (step,) = read_metrics(tmp_path / "same")
    assert abs(step["kd_loss"]) < 1e-6 and abs(step["loss"]) < 1e-6, res.stdout[-2000:]


def other_vocabulary(base: Path, out: Path, grow: bool) -> Path:
    """A copy of the teacher whose tokenizer has one more token (grow) or two ids' strings swapped."""
    shutil.copytree(base, out)
    spec = json.loads((out / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    if grow:
        vocab["zzextra"] = len(vocab)
    else:
        (a, i), (b, j) = list(vocab.items())[300:302]
        vocab[a], vocab[b] = j, i
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


@pytest.mark.slow
def test_distill_bad_inputs_are_one_line_before_any_process_group(tmp_path, base):
    cases = {
        ("distill.teacher_path=outputs/nowhere/hf",): "distill.teacher_path: no such directory: outputs/nowhere/hf",
        (f"distill.teacher_path={other_vocabulary(base, tmp_path / 'grown', True)}",): "has 513 tokens",
        (f"distill.teacher_path={other_vocabulary(base, tmp_path / 'swapped', False)}",): "token id 300 is",
        ("distill.top_k=100000",): "distill.top_k: 100000 is not below the vocabulary's",
        ("distill.loss=kl",): "distill.loss",
        ("train.loss_impl=full",): "train.loss_impl: recipes/distill.py computes its loss chunked",
    }
    procs = {}  # all at once: each stops in its set-up
    for i, overrides in enumerate(cases):
        args = [a for a in distill_args(base) if not a.startswith(tuple(o.split("=")[0] + "=" for o in overrides))]
        procs[overrides] = start_recipe(tmp_path / f"bad{i}", *args, *overrides, script=DISTILL)
    for overrides, proc in procs.items():
        res = finish_recipe(proc, check=False)
        assert res.returncode == 2 and cases[overrides] in res.stderr, (overrides, res.stderr[-2000:])
        assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr[-2000:]


# -- the offline teacher (distill.teacher_logits) --

PRECOMPUTE = REPO / "llmtrain" / "tools" / "distill_precompute.py"


@pytest.fixture(scope="module")
def store(tmp_path_factory, base) -> Path:
    """The teacher's top-8 log-probs at temperature 1.5 (test_distill's KD settings), computed by 2 ranks."""
    out = tmp_path_factory.mktemp("kd-store") / "store"
    launch(["-m", "llmtrain.tools.distill_precompute", "--config", TINY, "--out", out,
            *distill_args(base, "parallel.strategy=fsdp2")], nproc=2)
    return out


@pytest.fixture(scope="module")
def offline_runs(tmp_path_factory, base, store, distill_runs) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("distill-offline")
    val = distill_runs["none"].parent / "val.jsonl"  # the online runs' 10 validation rows
    runs = {  # the online runs' layouts (global batch 4 rows)
        "none": (1, ("parallel.strategy=none", "checkpoint.every_steps=2")),
        "fsdp2": (2, ("parallel.strategy=fsdp2", "train.micro_batch_size=1", "train.grad_accum_steps=2",
                      f"data.val_path={val}", "eval.every_steps=4")),
    }
    results = run_side_by_side({name: (root / name, ranks, distill_args(base, f"distill.teacher_logits={store}",
                                                                        *extra), DISTILL)
                                for name, (ranks, extra) in runs.items()}, at_once=2)
    for name, res in results.items():
        (root / name / "stdout.log").write_text(res.stdout)
    return {name: root / name for name in runs}


def steps(output_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(output_dir) if "loss" in r}


@pytest.mark.slow
def test_offline_teacher_gives_the_online_losses(offline_runs, distill_runs, store):
    manifest = json.loads((store / stored.MANIFEST).read_text())
    assert [s["file"] for s in manifest["shards"]] == ["rank00000.safetensors", "rank00001.safetensors"]
    assert (manifest["top_k"], manifest["temperature"], manifest["samples"]) == (8, 1.5, 32)
    for name in ("none", "fsdp2"):
        got, want = steps(offline_runs[name]), steps(distill_runs[name])
        assert sorted(got) == [1, 2, 3, 4], name
        for step in got:
            for key in ("loss", "kd_loss", "ce_loss"):
                assert got[step][key] == pytest.approx(want[step][key], abs=TOL), (name, step, key)
            assert got[step]["kd_loss"] == pytest.approx(want[step]["kd_loss"], rel=1e-5, abs=1e-9), (name, step)
        log = (offline_runs[name] / "stdout.log").read_text()
        assert f"distill: offline teacher {store}" in log and "distill: teacher" not in log, log  # none loaded
    online_eval = [r for r in read_metrics(distill_runs["fsdp2"]) if "val_loss" in r][0]
    (offline_eval,) = [r for r in read_metrics(offline_runs["fsdp2"]) if "val_loss" in r]
    assert offline_eval["val_loss"] == pytest.approx(online_eval["val_loss"], abs=TOL)
    assert "val_kd_loss" not in offline_eval and "val_teacher_loss" not in offline_eval


@pytest.mark.slow
def test_offline_teacher_resumes_exactly_on_another_world_size(tmp_path, offline_runs, base, store):
    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(offline_runs["none"] / "checkpoints" / "step_2", out / "checkpoints" / "step_2")
    res = run_recipe(out, *distill_args(base, f"distill.teacher_logits={store}", "parallel.strategy=fsdp2",
                                        "train.micro_batch_size=2"), nproc=2, script=DISTILL)
    assert "resumed at step 2" in res.stdout
    got, want = losses_by_step(out), losses_by_step(offline_runs["none"])
    assert [got[s] for s in (3, 4)] == pytest.approx([want[s] for s in (3, 4)], abs=TOL)


@pytest.mark.slow
def test_offline_teacher_bad_inputs_are_one_line_before_any_process_group(tmp_path, base, store, run_setup):
    damaged = tmp_path / "damaged"
    shutil.copytree(store, damaged)
    shard = damaged / "rank00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 1
    shard.write_bytes(bytes(raw))
    (tmp_path / "empty").mkdir()
    other = REPO / "data" / "demo" / "train.jsonl"
    fingerprints = (json.loads((store / stored.MANIFEST).read_text())["data"],
                    data_fingerprint(DataConfig(path=str(other))))
    grown = other_vocabulary(base, tmp_path / "grown", True)
    cases = {
        (f"distill.teacher_logits={tmp_path / 'nowhere'}",): "distill.teacher_logits: no such directory",
        (f"distill.teacher_logits={tmp_path / 'empty'}",): "has no manifest.json",
        (f"distill.teacher_logits={store}", f"data.path={other}"):
            "was computed from other data (fingerprint {}; this run's data files have {}); run python -m "
            "llmtrain.tools.distill_precompute".format(*fingerprints),
        (f"distill.teacher_logits={store}", "distill.top_k=4"): "distill.top_k: 4, but",
        (f"distill.teacher_logits={store}", "distill.top_k=0"): "distill.top_k: 0 (the whole vocabulary)",
        (f"distill.teacher_logits={store}", f"tokenizer.path={grown}"): "another tokenizer (512 tokens",
        (f"distill.teacher_logits={store}", "distill.temperature=1"): "distill.temperature: 1, but",
        (f"distill.teacher_logits={damaged}",): "rank00001.safetensors is damaged",
    }
    for overrides, message in cases.items():
        args = [a for a in distill_args(base) if not a.startswith(tuple(o.split("=")[0] + "=" for o in overrides))]
        code, _, err = run_setup(DISTILL, "--config", TINY, f"output_dir={tmp_path / 'out'}", *args, *overrides)
        assert code == 2 and message in err, (overrides, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for args, message in {("--out", store): f"--out: {store} exists",
                          ("--out", tmp_path / "new", "distill.top_k=0"): "distill.top_k: 0"}.items():
        code, _, err = run_setup(PRECOMPUTE, "--config", TINY, *distill_args(base), *args)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (args, err)
