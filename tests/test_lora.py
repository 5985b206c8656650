"""LoRA (PEFT) on a saved tiny model as model.path: the same losses on every strategy, world size and
accumulation split (also with activation checkpointing); the frozen base unchanged bit for bit; exports
that PEFT and transformers load with the trained logits; adapter-only checkpoints that resume exactly
(also at another world size and strategy) and refuse another base; modules_to_save and init_from."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from conftest import EXPORT_LOGITS, RECIPE, launch, losses, losses_by_step, run_recipe, run_side_by_side
from test_export import HF_LOGITS, assert_export_matches

TOL = 2e-5
SPLITS = {  # name: (ranks, micro, accum, overrides, script); global batch 4 rows in each
    "none": (1, 4, 1, ("parallel.strategy=none", "checkpoint.every_steps=2"), EXPORT_LOGITS),
    "ddp": (2, 1, 2, ("parallel.strategy=ddp",), RECIPE),
    "fsdp": (2, 2, 1, ("parallel.strategy=fsdp",), EXPORT_LOGITS),
    "fsdp2_ac": (2, 1, 2, ("parallel.strategy=fsdp2", "parallel.activation_checkpointing=true"), EXPORT_LOGITS),
}


@pytest.fixture(scope="session")
def base(reference_run) -> Path:
    """The reference run's export: a tiny Llama in Hugging Face format (model.safetensors, tied embeddings)."""
    return reference_run / "hf"


def lora_args(base: Path, *extra: str) -> list[str]:
    return ["model.config=null", f"model.path={base}", "lora.enabled=true", "lora.r=4", "lora.alpha=8",
            "lora.dropout=0", "train.lr=1e-2", *extra]


@pytest.fixture(scope="session")
def lora_runs(tmp_path_factory, base) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    runs = {name: (root / name, ranks, lora_args(base, f"train.micro_batch_size={micro}",
                                                 f"train.grad_accum_steps={accum}", *extra), script)
            for name, (ranks, micro, accum, extra, script) in SPLITS.items()}
    results = run_side_by_side(runs, at_once=len(runs))
    assert re.search(r"lora: trainable \S+K of \S+K \(\d+\.\d\d%\)", results["none"].stdout), results["none"].stdout
    return {name: out for name, (out, *_) in runs.items()}


def hf_logits_diff(hf: Path, probe: Path, adapter: Path | None = None) -> float:
    res = launch([HF_LOGITS, hf, probe, *([adapter] if adapter else [])], torchrun=False)
    assert res.returncode == 0, res.stderr[-4000:]
    return float(re.search(r"maxdiff=(\S+)", res.stdout).group(1))


@pytest.mark.slow
def test_lora_losses_match_across_strategies_ranks_and_accumulation(lora_runs):
    ref = losses(lora_runs["none"])
    assert len(ref) == 4 and ref[-1] < ref[0], ref  # the adapters learn
    for name, out in lora_runs.items():
        assert losses(out) == pytest.approx(ref, abs=TOL), name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["none", "fsdp", "fsdp2_ac"])
def test_lora_base_unchanged_and_exports_give_trained_logits(lora_runs, base, name):
    out = lora_runs[name]
    trained, original = load_file(out / "frozen.safetensors"), load_file(base / "model.safetensors")
    for key, tensor in original.items():
        assert torch.equal(trained[key], tensor), f"frozen {key} changed"
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert len(adapter) == 2 * 7 * 2  # lora_A and lora_B of 7 linear layers x 2 decoder layers: complete
    assert all(t.abs().sum() > 0 for k, t in adapter.items() if "lora_B" in k)  # started at zero, trained
    assert_export_matches(out)  # merged: output_dir/hf in plain transformers
    assert hf_logits_diff(base, out / "probe.safetensors", out / "adapter") < 1e-5  # base + PeftModel


@pytest.mark.slow
def test_lora_checkpoint_holds_adapters_and_resumes_exactly_elsewhere(tmp_path, lora_runs, base):
    """From 1 process (none) at step 2 to 2 ranks on fsdp2 and on fsdp: steps 3-4 as uninterrupted."""
    ckpt = lora_runs["none"] / "checkpoints" / "step_2"
    saved = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys  # no frozen base
    runs = {}
    for strategy in ("fsdp2", "fsdp"):
        out = tmp_path / strategy
        (out / "checkpoints").mkdir(parents=True)
        shutil.copytree(ckpt, out / "checkpoints" / "step_2")
        runs[strategy] = (out, 2, lora_args(base, f"parallel.strategy={strategy}", "train.micro_batch_size=2"),
                          RECIPE)
    results = run_side_by_side(runs, at_once=2)
    full = losses_by_step(lora_runs["none"])
    for strategy, (out, *_) in runs.items():
        assert "resumed at step 2" in results[strategy].stdout
        got = losses_by_step(out)
        assert [got[s] for s in (3, 4)] == pytest.approx([full[3], full[4]], abs=TOL), strategy


def test_lora_resume_refuses_another_base_or_lora_off(tmp_path, lora_runs, base):
    ckpt = lora_runs["none"] / "checkpoints" / "step_2"
    other = tmp_path / "other"
    shutil.copytree(base, other)
    weights = load_file(other / "model.safetensors")
    weights["model.norm.weight"] += 1  # same names, shapes and sizes: only the bytes differ
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    res = run_recipe(tmp_path / "run", *lora_args(other, f"checkpoint.resume={ckpt}"), check=False, torchrun=False)
    assert res.returncode == 2 and "was trained on the base" in res.stderr, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    res = run_recipe(tmp_path / "run", *lora_args(base, f"checkpoint.resume={ckpt}", "lora.enabled=false"),
                     check=False, torchrun=False)
    assert res.returncode == 2 and "holds LoRA adapters only" in res.stderr, res.stderr[-2000:]


@pytest.mark.slow
def test_lora_modules_to_save_and_init_from_round_trip(tmp_path, base):
    """Train adapters + the final norm (2 ranks, fsdp2); continue from the exported adapter directory in one
    process: with a negligible lr the continued model gives the first one's logits."""
    first, second = tmp_path / "first", tmp_path / "second"
    run_recipe(first, *lora_args(base, "lora.modules_to_save=[model.norm]", "parallel.strategy=fsdp2",
                                 "train.micro_batch_size=2", "train.max_steps=2"), nproc=2, script=EXPORT_LOGITS)
    adapter = load_file(first / "adapter" / "adapter_model.safetensors")
    norm = adapter["base_model.model.model.norm.weight"]
    assert not torch.equal(norm, load_file(base / "model.safetensors")["model.norm.weight"])  # trained
    assert hf_logits_diff(base, first / "probe.safetensors", first / "adapter") < 1e-5
    assert_export_matches(first)
    run_recipe(second, *lora_args(base, "lora.modules_to_save=[model.norm]", f"lora.init_from={first / 'adapter'}",
                                  "train.lr=1e-30", "train.max_steps=1", "lora.export=adapter"), script=EXPORT_LOGITS)
    assert not (second / "hf").exists()
    assert hf_logits_diff(base, first / "probe.safetensors", second / "adapter") < 1e-5
    diff = load_file(second / "probe.safetensors")["logits"] - load_file(first / "probe.safetensors")["logits"]
    assert diff.abs().max() < 1e-5


def test_lora_bad_settings_name_the_key(tmp_path, base):
    res = run_recipe(tmp_path, *lora_args(base, "lora.target_modules=[q_proj,qkv]"), check=False, torchrun=False)
    assert res.returncode == 2 and "lora.target_modules: ['qkv'] match no linear layer" in res.stderr, res.stderr
    assert "'down_proj', 'gate_proj'" in res.stderr  # what exists
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    res = run_recipe(tmp_path, *lora_args(base, f"lora.init_from={adapter}"), check=False, torchrun=False)
    assert res.returncode == 2 and "lora.init_from" in res.stderr and "has r=8 but lora.r=4" in res.stderr, res.stderr
    res = run_recipe(tmp_path, *lora_args(base, "lora.base_dtype=bf16"), check=False, torchrun=False)
    assert res.returncode == 2 and "needs parallel.mixed_precision=bf16" in res.stderr
