"""Bad input fails before any process group or model exists, naming the key and the valid choices."""

from __future__ import annotations

import pytest

from helpers import RECIPE, TINY
from helpers.procs import launch
from llmtrain.config import ConfigError, describe, load_config, to_yaml


def test_yaml_and_overrides_are_typed():
    cfg = load_config(TINY, ["train.lr=1e-4", "train.max_steps=7", "parallel.strategy=fsdp2",
                             "model.config.hidden_size=48", "train.betas=[0.9,0.99]"])
    assert cfg.train.lr == 1e-4 and isinstance(cfg.train.lr, float)
    assert cfg.train.max_steps == 7
    assert cfg.parallel.strategy == "fsdp2"
    assert cfg.model.config["hidden_size"] == 48
    assert cfg.train.betas == [0.9, 0.99]
    assert load_config(TINY) == load_config(TINY, [])
    assert "strategy: fsdp2" in to_yaml(cfg)


@pytest.mark.parametrize("override,words", [
    (["train.lrr=1"], ["unknown config key 'train.lrr'", "did you mean 'train.lr'"]),
    (["trian.lr=1"], ["unknown config key 'trian'", "did you mean 'train'"]),
    (["train.max_steps=abc"], ["train.max_steps", "expected int", "'abc'"]),
    (["train.max_steps=1.5"], ["train.max_steps", "expected int"]),
    (["log.progress=maybe"], ["log.progress", "expected bool"]),
    (["parallel.strategy=fsdp3"], ["parallel.strategy", "fsdp3", "ddp, fsdp, fsdp2, none"]),
    (["parallel.mixed_precision=fp8"], ["parallel.mixed_precision", "fp32, bf16, fp16"]),
    (["train.micro_batch_size=0"], ["train.micro_batch_size must be >= 1"]),
    (["train.loss_impl=fused"], ["train.loss_impl", "chunked, full, liger"]),
    (["train.loss_chunk_tokens=-1"], ["train.loss_chunk_tokens must be >= 0"]),
    (["train"], ["must look like key.sub=value"]),
    (["model.path=/x", ], ["exactly one of model.path"]),
])
def test_bad_config_names_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, override)
    for w in words:
        assert w in str(e.value)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")


def test_every_key_is_described():
    rows = describe()
    keys = {r[0] for r in rows}
    assert {"train.lr", "parallel.strategy", "data.seq_len", "model.path", "output_dir"} <= keys
    assert all(r[3] for r in rows), [r[0] for r in rows if not r[3]]


@pytest.mark.parametrize("args,words", [
    (["train.lrr=1"], ["train.lrr", "train.lr"]),
    (["parallel.strategy=bogus"], ["parallel.strategy", "ddp, fsdp, fsdp2, none"]),
    (["data.path=/no/such/file.jsonl"], ["data.path", "/no/such/file.jsonl"]),
    (["tokenizer.path=/no/such/dir"], ["tokenizer.path", "/no/such/dir"]),
    (["parallel.strategy=none"], ["parallel.strategy=none", "2 were launched"]),
    (["parallel.strategy=fsdp2", "parallel.replicate=3"], ["parallel.replicate=3", "world size 2"]),
    (["parallel.strategy=ddp", "train.loss_impl=liger"], ["train.loss_impl=liger", "on cpu", "loss_impl=chunked"]),
])
@pytest.mark.slow
def test_cli_errors_exit_nonzero_on_every_rank(tmp_path, args, words):
    res = launch([RECIPE, "--config", TINY, f"output_dir={tmp_path}", *args], nproc=2, timeout=60)
    assert res.returncode != 0
    assert "error:" in res.stderr and "Traceback" not in res.stderr.split("error:")[0][-200:]
    for w in words:
        assert w in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_incomplete_weights_are_named_on_every_rank(tmp_path):
    import torch
    import yaml
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    model_dir = tmp_path / "model"
    LlamaConfig(**yaml.safe_load(TINY.read_text())["model"]["config"], vocab_size=512).save_pretrained(model_dir)
    save_file({"model.norm.weight": torch.ones(32)}, model_dir / "model.safetensors")
    res = launch([RECIPE, "--config", TINY, f"output_dir={tmp_path / 'out'}", "model.config=null",
                  f"model.path={model_dir}", "parallel.strategy=fsdp"], nproc=2, timeout=90)
    assert res.returncode != 0
    for w in ("error (rank 0): model.path: weights missing", "error (rank 1): model.path: weights missing",
              "model.embed_tokens.weight", "is this a llama checkpoint?"):
        assert w in res.stderr, res.stderr[-2000:]


@pytest.mark.slow
def test_print_config_and_help(tmp_path):
    res = launch([RECIPE, "--config", TINY, "train.lr=5e-4", "--print-config"], torchrun=False, timeout=60)
    assert res.returncode == 0 and "lr: 0.0005" in res.stdout
    res = launch([RECIPE, "--help-config"], torchrun=False, timeout=60)
    assert res.returncode == 0 and "parallel.strategy" in res.stdout and "Linear scaling" in res.stdout
