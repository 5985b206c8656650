"""The consolidated export of the plainest run (the reference: one process, no wrapper) holds the trained
weights: tensor for tensor the offline conversion of its last checkpoint (the model as DCP saved it). The
reference fixture loads it in plain transformers (no llmtrain import): its logits there are the baseline that
the other runs' exports must reproduce (tests/helpers/export.py)."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import REPO
from helpers.procs import launch, run_recipe
from llmtrain.convert import CheckpointError, check_out
from llmtrain.convert import main as convert_main
from llmtrain.models import lora


@pytest.mark.slow
def test_export_of_single_process_run(tmp_path, reference_run):
    res = launch(["-m", "llmtrain.convert", reference_run / "checkpoints" / "step_4", tmp_path], timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    converted = load_file(tmp_path / "model.safetensors")
    exported = load_file(reference_run / "hf" / "model.safetensors")
    assert converted.keys() == exported.keys()
    for name, tensor in exported.items():
        assert torch.equal(converted[name], tensor), name
    for out in (tmp_path, reference_run / "hf"):  # an inline model.config's export names its class too
        assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_convert_overwrite_replaces_only_a_previous_export(tmp_path, reference_run, capsys):
    """`python -m llmtrain.convert --overwrite` never replaces the run, its checkpoints or the checkpoint read, nor a
    directory that is not an export; one line, exit 2, nothing changed. A previous export (the run's hf/, or an
    OUT the converter wrote) is replaced."""
    run = tmp_path / "run"
    shutil.copytree(reference_run / "checkpoints" / "step_4", run / "checkpoints" / "step_4")
    (run / "config.yaml").write_text((reference_run / "config.yaml").read_text())
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out").write_text("x")
    ckpt = run / "checkpoints" / "step_4"
    before = tree(tmp_path)
    for out, words in ((run, f"OUT {run} is the run directory of the checkpoint"),
                       (tmp_path, f"OUT {tmp_path} holds the run directory of the checkpoint"),
                       (run / "checkpoints", f"OUT {run / 'checkpoints'} holds the checkpoint"),
                       (ckpt, f"OUT {ckpt} is the checkpoint"),
                       (ckpt / "hf", f"OUT {ckpt / 'hf'} lies inside the checkpoint"),
                       (run / "tensorboard", f"{run / 'tensorboard'} is not a previous export")):
        assert convert_main([str(ckpt), str(out), "--overwrite"]) == 2
        out_text, err = capsys.readouterr()
        assert out_text == "" and err.startswith(f"error: {words}") and err.count("\n") == 1, err
        assert tree(tmp_path) == before, out
    export = run / "hf-step4"  # beside the checkpoints: a fresh OUT, then a previous export
    assert convert_main([str(ckpt), str(export)]) == 0
    assert convert_main([str(ckpt), str(export), "--dtype", "bf16"]) == 2
    assert convert_main([str(ckpt), str(export), "--dtype", "bf16", "--overwrite"]) == 0
    assert load_file(export / "model.safetensors")["model.norm.weight"].dtype == torch.bfloat16
    (export / "notes.yaml").write_text("mine\n")
    capsys.readouterr()
    assert convert_main([str(ckpt), str(export), "--overwrite"]) == 2
    assert "is not a previous export" in capsys.readouterr().err and (export / "notes.yaml").is_file()


@pytest.mark.slow
def test_a_lora_checkpoint_into_a_non_empty_out_is_refused_like_a_full_one(tmp_path, capsys):
    run = tmp_path / "run"
    run_recipe(run, "lora.enabled=true", "lora.r=4", "lora.export=adapter", "train.max_steps=2",
               "checkpoint.every_steps=2")
    ckpt, out = run / "checkpoints" / "step_2", tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    assert convert_main([str(ckpt), str(out)]) == 2
    assert capsys.readouterr().err == f"error: {out} exists: pass --overwrite to replace it\n"
    assert convert_main([str(ckpt), str(out), "--overwrite"]) == 2
    assert "is not a previous export" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    (out / "notes.txt").unlink()
    assert convert_main([str(ckpt), str(out)]) == 0 and (out / "adapter" / lora.ADAPTER_WEIGHTS).is_file()
    assert convert_main([str(ckpt), str(out), "--overwrite"]) == 0  # its own previous export


def test_a_lora_out_over_its_base_is_refused(tmp_path):
    base, ckpt = tmp_path / "base", tmp_path / "run" / "checkpoints" / "step_2"
    ckpt.mkdir(parents=True), base.mkdir()
    for out, how in ((base, "is"), (base / "x", "lies inside"), (tmp_path, "holds")):
        with pytest.raises(CheckpointError, match=rf"^OUT {out} {how} (the run directory of|model.path)"):
            check_out(ckpt, out, ("adapter", "hf"), str(base), overwrite=True)
    check_out(ckpt, tmp_path / "elsewhere", ("adapter", "hf"), str(base), overwrite=True)


def test_export_files_follow_the_umask(tmp_path):
    """safetensors' save_file creates its files 0600 whatever the umask: an export (write_hf and write_adapter,
    which the run's final and periodic exports and llmtrain.convert write with) gives every file the mode open()
    gives a new file, 0666 less the umask, as the config and tokenizer files beside the weights have."""
    from transformers import LlamaConfig

    from llmtrain.config import LoraConfig
    from llmtrain.export import write_adapter, write_hf
    from llmtrain.models.hf import load_tokenizer

    tokenizer = load_tokenizer(str(REPO / "assets" / "tokenizer"), False)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id)
    state = {"model.embed_tokens.weight": torch.randn(len(tokenizer), 8), "model.norm.weight": torch.ones(8)}
    adapter = {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 8),
               "model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, 4)}
    mask = os.umask(0o027)  # neither safetensors' 0600 nor the usual 0644
    try:
        write_hf(state, tmp_path / "hf", config, tokenizer, torch.float32)
        write_hf(dict(state), tmp_path / "sharded", config, tokenizer, torch.float32, max_shard_size="5KB")
        write_adapter(adapter, tmp_path / "adapter", LoraConfig(enabled=True, r=4), None)
    finally:
        os.umask(mask)
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode)
             for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    assert {"hf/model.safetensors", "sharded/model-00002-of-00002.safetensors",
            "adapter/adapter_model.safetensors"} <= modes.keys(), sorted(modes)
    assert modes == dict.fromkeys(modes, 0o640), modes
