"""Resuming with a changed setup (llmtrain/resume.py): each change a user makes is either continued with a line
saying what changed, or refused before anything is loaded, naming every differing key with old -> new (never
advice to move a healthy checkpoint away); checkpoint.allow_changes lets a user who means it continue. With no
checkpoint to resume from, a run says what of an earlier run in its output_dir it replaces."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from helpers import REPO
from helpers.procs import read_metrics, run_recipe

pytestmark = pytest.mark.slow

SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, tie_word_embeddings=True)
FIRST = ["model.config=null", "train.max_steps=2", "checkpoint.every_steps=2"]
RESUME = ["model.config=null", "train.max_steps=3", "checkpoint.every_steps=2"]


def save_model(path: Path, **shape) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(REPO / "assets" / "tokenizer")
    torch.manual_seed(0)
    config = LlamaConfig(**{**SHAPE, **shape}, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    a = save_model(root / "a")
    b = Path(shutil.copytree(a, root / "b"))  # same shapes, other weights
    weights = load_file(b / "model.safetensors")
    weights["model.norm.weight"] += 1
    save_file(weights, b / "model.safetensors", metadata={"format": "pt"})
    return {"a": a, "b": b, "wider": save_model(root / "wider", hidden_size=64, intermediate_size=128)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, models) -> dict[str, Path]:
    """Two 2-step runs on model a with a checkpoint at step 2: a full fine-tune and a LoRA one."""
    root = tmp_path_factory.mktemp("saved")
    run_recipe(root / "full", *FIRST, f"model.path={models['a']}")
    run_recipe(root / "lora", *FIRST, f"model.path={models['a']}", "lora.enabled=true")
    return {"full": root / "full", "lora": root / "lora"}


def resume(saved: Path, tmp_path: Path, *changes: str):
    out = Path(shutil.copytree(saved, tmp_path / "run"))
    return run_recipe(out, *RESUME, *changes, check=False)


def refused(res, *wanted: str) -> str:
    assert res.returncode == 2, res.stderr[-3000:]
    line = [x for x in res.stderr.splitlines() if x.startswith("error")][-1]
    assert "was saved by a different setup" in line and "move it away" not in res.stderr
    for w in wanted:
        assert w in line, line
    return line


def test_a_changed_global_batch_is_refused_unless_allowed(saved, models, tmp_path):
    res = resume(saved["full"], tmp_path, f"model.path={models['a']}", "train.grad_accum_steps=2")
    refused(res, "train.grad_accum_steps: global batch 4 -> 8", "the data order and the loss curve change")
    shutil.rmtree(tmp_path / "run")
    res = resume(saved["full"], tmp_path, f"model.path={models['a']}", "train.grad_accum_steps=2",
                 "checkpoint.allow_changes=[train.grad_accum_steps]")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "global batch 4 -> 8" in res.stdout and "allowed by checkpoint.allow_changes" in res.stdout
    assert "resumed at step 2" in res.stdout


def test_other_data_is_refused_naming_data_path(saved, models, tmp_path):
    res = resume(saved["full"], tmp_path, f"model.path={models['a']}", "data.path=data/demo/train.jsonl")
    refused(res, "data.path: 'data/demo/val.jsonl' -> 'data/demo/train.jsonl'", "the data files differ")


def test_a_full_fine_tune_resumed_on_another_model_path_says_whose_weights(saved, models, tmp_path):
    res = resume(saved["full"], tmp_path, f"model.path={models['b']}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "the checkpoint's weights are used, not the new model.path's" in res.stdout
    assert "train.max_steps: 2 -> 3" in res.stdout and "resumed at step 2" in res.stdout


def test_another_architecture_is_refused_naming_model_path_and_the_shapes(saved, models, tmp_path):
    res = resume(saved["full"], tmp_path, f"model.path={models['wider']}")
    refused(res, "model.path: another architecture", "hidden_size 32 -> 64", "intermediate_size 64 -> 128")


@pytest.mark.parametrize("change, wanted", [
    ("lora.target_modules=[q_proj,v_proj]", "lora.target_modules: 'all-linear' -> ['q_proj', 'v_proj']"),
    ("lora.r=8", "lora.r: 16 -> 8"),
])
def test_lora_adapter_changes_are_refused_naming_the_key(saved, models, tmp_path, change, wanted):
    res = resume(saved["lora"], tmp_path, f"model.path={models['a']}", "lora.enabled=true", change)
    refused(res, wanted)


@pytest.mark.slow
def test_a_run_starting_over_in_an_earlier_runs_output_dir_says_what_it_replaces(tmp_path):
    """No checkpoint to resume from (none were written): the second run starts over, and says that it
    rewrites the first one's metrics and export, naming the way to keep them."""
    run_recipe(tmp_path, "train.max_steps=2")
    res = run_recipe(tmp_path, "train.max_steps=1")
    assert (f"note: output_dir {tmp_path} holds an earlier run's metrics.jsonl and hf/ and no checkpoint to resume "
            "from: this run starts over and replaces them (another output_dir keeps them)") in res.stdout
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
