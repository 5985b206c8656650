"""Distillation's set-up messages and its precompute's outputs: a teacher directory without tokenizer files, a
teacher whose vocab_size or context is too small, a stored-teacher manifest that is JSON but not a manifest, a
refused top_k or temperature: one line naming the teacher's side, exit 2, no traceback (in process, on a teacher
saved here). A precompute killed mid-way says so in one line; a finished one writes its shards with the umask's
mode, at the size per trained token docs/distill.md gives."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from helpers import REPO, TINY
from helpers.procs import finish, launch, start, worker_pids
from llmtrain.recipes.distill import teacher as stored

DISTILL = REPO / "recipes" / "distill.py"
PRECOMPUTE = REPO / "llmtrain" / "tools" / "distill_precompute.py"
TOKENIZER = REPO / "assets" / "tokenizer"
STUDENT = ("model.config.hidden_size=16", "model.config.num_hidden_layers=1", "data.packing=false")


def save_teacher(out: Path, tokenizer: bool = True, **config) -> Path:
    """A tiny Llama saved as a Hugging Face directory (the bundled tokenizer's 512 ids unless `config` says)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    settings = dict(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True)
    LlamaForCausalLM(LlamaConfig(**{**settings, **config})).save_pretrained(out)
    if tokenizer:
        for f in TOKENIZER.iterdir():
            shutil.copy(f, out)
    return out


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    return save_teacher(tmp_path_factory.mktemp("teacher") / "hf")


def test_teacher_set_up_errors_are_one_line_naming_the_teacher(tmp_path, teacher, run_setup):
    cases = {
        save_teacher(tmp_path / "no-tokenizer", tokenizer=False):
            rf"error: distill.teacher_path: no tokenizer could be loaded from {tmp_path / 'no-tokenizer'} \(.+\); "
            r"the teacher's directory holds its tokenizer \(the student's vocabulary\)",
        save_teacher(tmp_path / "small-vocab", vocab_size=500):
            rf"error: distill.teacher_path: the teacher's vocab_size is 500 \({tmp_path / 'small-vocab'}/config.json\),"
            r" fewer than the 512 tokens of the vocabulary it shares with the student: not a model of this tokenizer",
        save_teacher(tmp_path / "short", max_position_embeddings=32):
            r"error: data.seq_len=64 is longer than the teacher's \(distill.teacher_path\) "
            r"max_position_embeddings=32; lower data.seq_len \(or extend that context in its config first\)",
    }
    for path, line in cases.items():
        code, _, err = run_setup(DISTILL, "--config", TINY, f"output_dir={tmp_path / 'out'}", *STUDENT,
                                 f"distill.teacher_path={path}")
        assert code == 2 and re.fullmatch(line, err.strip()), (path, err)
        assert "tokenizer.path" not in err and "the model's" not in err


def test_refused_values_are_not_suggested(tmp_path, teacher, run_setup):
    """The precompute refuses top_k 0, so its too-large top_k does not suggest it (the recipe's does); an
    infinite temperature is named as such."""
    args = ("--config", TINY, *STUDENT, f"distill.teacher_path={teacher}", "distill.top_k=512")
    code, _, err = run_setup(PRECOMPUTE, *args, "--out", tmp_path / "store")
    assert code == 2 and err.strip() == "error: distill.top_k: 512 is not below the vocabulary's 512 ids; use a " \
                                        "smaller k", err
    code, _, err = run_setup(DISTILL, *args, f"output_dir={tmp_path / 'out'}")
    assert code == 2 and err.strip().endswith("use a smaller k, or 0 for the whole vocabulary"), err
    code, _, err = run_setup(DISTILL, "--config", TINY, f"output_dir={tmp_path / 'out'}", *STUDENT,
                             f"distill.teacher_path={teacher}", "distill.temperature=inf")
    assert code == 2 and err.strip() == "error: distill.temperature must be > 0 and finite, got inf", err


MANIFEST = {"version": stored.VERSION, "data": "x", "rows": {}, "vocab": 512, "tokens": "x", "top_k": 4,
            "temperature": 1.0, "samples": 1, "shards": []}


@pytest.mark.parametrize("manifest,says", [
    ([], "holds a JSON list, not a precompute's manifest (an object)"),
    ({k: v for k, v in MANIFEST.items() if k != "rows"}, "lacks rows (not a precompute's manifest)"),
    ({"version": stored.VERSION}, "lacks data, rows, vocab, tokens, top_k, temperature, samples, shards"),
], ids=["list", "no-rows", "version-only"])
def test_a_manifest_that_is_json_but_not_a_manifest_is_one_line(tmp_path, teacher, run_setup, manifest, says):
    store = tmp_path / "store"
    store.mkdir()
    (store / stored.MANIFEST).write_text(json.dumps(manifest))
    code, _, err = run_setup(DISTILL, "--config", TINY, f"output_dir={tmp_path / 'out'}", *STUDENT,
                             f"distill.teacher_path={teacher}", "distill.top_k=4", f"distill.teacher_logits={store}")
    assert code == 2 and err.startswith(f"error: distill.teacher_logits: {store / stored.MANIFEST} {says}"), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def precompute_args(teacher: Path, out: Path, *extra: str) -> list:
    return ["-m", "llmtrain.tools.distill_precompute", "--config", TINY, *STUDENT, f"distill.teacher_path={teacher}",
            "--out", out, *extra]


@pytest.mark.slow
def test_a_precompute_writes_shards_with_the_umask_at_the_documented_size(tmp_path, teacher):
    """docs/distill.md's bytes per trained token ((k + 1) fp32 log-probs and k int32 ids), checked against a real
    store: the shard is that times its trained tokens, plus 16 bytes per sample (position, offset) and the
    safetensors header. Its mode is what the umask gives any other file (safetensors writes 0600)."""
    k = 16
    launch(precompute_args(teacher, tmp_path / "store", f"distill.top_k={k}"))
    manifest = json.loads((tmp_path / "store" / stored.MANIFEST).read_text())
    (shard,) = manifest["shards"]
    path = tmp_path / "store" / shard["file"]
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask
    doc = (REPO / "docs" / "distill.md").read_text()
    m = re.search(r"\((\d+)k \+ (\d+)\) bytes per trained token, (\d+) at k = (\d+)", doc)
    per_token, at = int(m[1]) * k + int(m[2]), int(m[4])
    assert int(m[3]) == int(m[1]) * at + int(m[2])
    overhead = path.stat().st_size - shard["tokens"] * per_token
    assert 16 * shard["samples"] <= overhead <= 16 * shard["samples"] + 1024, (overhead, shard)


@pytest.mark.slow
def test_a_killed_precompute_says_so_in_one_line(tmp_path, teacher):
    """Rank 1 killed mid-way: torchrun stops rank 0 (SIGTERM), which says in one line that it stopped, that rank
    1 is gone, and that the store was not written; nothing appears at --out."""
    out = tmp_path / "store"
    proc = start(precompute_args(teacher, out, "distill.top_k=4", "--samples", "1000000"), nproc=2, torchrun=True)
    deadline = time.monotonic() + 120
    while not stored.partial_dir(out).is_dir():  # the ranks are past their set-up, computing
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.1)
    time.sleep(1)
    os.kill(worker_pids(proc.pid)[1], signal.SIGKILL)
    res = finish(proc, timeout=90)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, res.stderr[-3000:]
    assert re.fullmatch(rf"error \(rank 0\): distill_precompute stopped by SIGTERM \(rank 1 .+\); {out} was not "
                        r"written \(it appears only when complete\): run the command again", errors[0]), errors[0]
    assert not re.search(r'File ".*/llmtrain/', res.stderr) and not out.exists()  # torchrun's own traceback only
