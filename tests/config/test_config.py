"""Bad input fails before any process group or model exists, naming the key and the valid choices."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from helpers import REPO, RECIPE, TINY, recipe_configs
from helpers.procs import launch
from llmtrain.config import ConfigError, Range, describe, load_config, to_yaml
from llmtrain.recipes.dpo import DPOConfig


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
    (["train.micro_batch_size=0"], ["train.micro_batch_size must be >= 1, got 0"]),
    (["train.loss_impl=fused"], ["train.loss_impl", "chunked, full, liger"]),
    (["train.loss_chunk_tokens=-1"], ["train.loss_chunk_tokens must be >= 0, got -1"]),
    (["train.betas=[0.9,1.0]"], ["train.betas[1] must be in [0, 1), got 1.0"]),
    (["data.val_fraction=.nan"], ["data.val_fraction must be in [0, 1), got nan"]),
    (["train"], ["must look like key.sub=value"]),
    (["model.path=/x", ], ["exactly one of model.path"]),
])
def test_bad_config_names_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, override)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("text,line", [
    ("train:\n  lr: 1.0e-3\n  max_steps: 4\n  lr: 1.0e-4\n", "key 'lr' is given twice in one mapping (lines 2 and 4)"),
    ("train:\n  lr: 1.0e-3\nlog:\n  every_steps: 1\ntrain:\n  max_steps: 4\n",
     "key 'train' is given twice in one mapping (lines 1 and 5)"),
    ("model:\n  config:\n    hidden_size: 32\n    hidden_size: 64\n",
     "key 'hidden_size' is given twice in one mapping (lines 3 and 4)"),
])
def test_a_key_given_twice_in_a_yaml_config_is_refused_naming_both_lines(tmp_path, text, line):
    """YAML keeps the last of two equal keys without a word: the first would be silently ignored."""
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: {line}; keep one"
    path.write_text(TINY.read_text())
    assert load_config(path) == load_config(TINY)


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
    (["model.config.num_hidden_layerz=3"], ["unknown config key 'model.config.num_hidden_layerz'",
                                            "did you mean 'model.config.num_hidden_layers'"]),
    (["model.config=null", f"model.path={REPO / 'README.md'}"],
     [f"model.path: {REPO / 'README.md'} is a file, not a directory (name the directory that holds it)"]),
])
def test_cli_errors_exit_2_at_set_up(tmp_path, run_setup, args, words):
    """As each of 2 ranks sees it (WORLD_SIZE=2), in this process: set-up stops before the process group."""
    code, out, err = run_setup(RECIPE, "--config", TINY, f"output_dir={tmp_path}", *args, world_size=2)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_cli_error_exits_nonzero_from_real_ranks(tmp_path):
    """The path of a set-up error's message out of 2 real ranks (the in-process cases above check each message)."""
    res = launch([RECIPE, "--config", TINY, f"output_dir={tmp_path}", "parallel.strategy=none"], nproc=2, timeout=60)
    assert res.returncode != 0
    assert "error:" in res.stderr and "Traceback" not in res.stderr.split("error:")[0][-200:]
    for w in ("parallel.strategy=none", "2 were launched"):
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
                  f"model.path={model_dir}", "parallel.strategy=fsdp"], nproc=2, timeout=90, torchrun=True)
    assert res.returncode != 0
    for w in ("model.embed_tokens.weight", "is this a llama checkpoint?"):
        assert w in res.stderr, res.stderr[-2000:]
    # Both ranks find it alike: the console shows it once (torchrun's report repeats it per rank, indented).
    assert len([line for line in res.stderr.splitlines() if line.startswith("error: model.path: weights missing")]) \
        == 1, res.stderr[-2000:]


def test_print_config_and_help(run_setup):
    code, out, _ = run_setup(RECIPE, "--config", TINY, "train.lr=5e-4", "--print-config")
    assert code == 0 and "lr: 0.0005" in out
    code, out, _ = run_setup(RECIPE, "--help-config")
    assert code == 0 and "parallel.strategy" in out and "Linear scaling" in out


def _numeric_keys(cls: type, prefix: str = ""):
    """(dotted key, dataclass field, annotation) of every int/float key (lists of them too), through sections and
    lists of sections (data.sources[0].weight)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], prefix + f.name.rstrip("_")
        if dataclasses.is_dataclass(tp):
            yield from _numeric_keys(tp, f"{key}.")
            continue
        args = [a for a in (tp, *typing.get_args(tp)) if a is not type(None)]
        for arg in args:
            if typing.get_origin(arg) is list and dataclasses.is_dataclass(typing.get_args(arg)[0]):
                yield from _numeric_keys(typing.get_args(arg)[0], f"{key}[0].")
        if {int, float} & {*args, *(a for arg in args for a in typing.get_args(arg))}:
            yield key, f, tp


# (key, field, annotation, the config class to load it with), each key once
NUMERIC = list({key: (key, f, tp, cls) for cls in recipe_configs() for key, f, tp in _numeric_keys(cls)}.values())


def _override(key: str, value) -> list[str]:
    if key == "train.betas":
        return [f"train.betas=[{value!r}, 0.95]"]
    if key == "grpo.reward_weights":
        return [f"grpo.reward_weights=[{value!r}]"]
    if key.startswith("data.sources[0]."):
        return ["data.path=", f"data.sources=[{{path: data/demo/val.jsonl, {key.split('.')[-1]}: {value!r}}}]"]
    return [f"{key}={value!r}"]


def _edges(valid: Range, is_int: bool) -> tuple[list, list]:
    """(just outside, just inside) values at each finite bound of the range."""
    outside, inside = [], []
    for bound, closed, away in ((valid.lo, valid.lo_closed, -math.inf), (valid.hi, valid.hi_closed, math.inf)):
        if math.isinf(bound):
            continue
        step_out = (bound - 1 if away < 0 else bound + 1) if is_int else math.nextafter(bound, away)
        step_in = (bound + 1 if away < 0 else bound - 1) if is_int else math.nextafter(bound, -away)
        outside.append(step_out if closed else bound)
        inside.append(bound if closed else step_in)
    return outside, inside


def test_every_numeric_key_declares_a_range():
    keys = {key for key, *_ in NUMERIC}
    assert {"lora.alpha", "lora.r", "train.lr", "train.betas", "data.sources[0].weight", "log.peak_tflops",
            "dpo.beta", "dpo.label_smoothing"} <= keys
    assert [key for key, f, *_ in NUMERIC if "range" not in f.metadata] == []
    rows = {r[0]: r[1] for r in describe(DPOConfig)}  # --help-config shows each range
    assert rows["lora.alpha"] == "float, > 0" and rows["train.betas"] == "list[float], each in [0, 1)"
    assert rows["data.val_fraction"] == "float, in [0, 1)" and rows["data.sources[].weight"] == "float, > 0"


def _value(cfg, key: str):
    """cfg's value at a dotted key; a list's first item (train.betas, data.sources[0])."""
    for part in key.replace("[0]", "").split("."):
        cfg = getattr(cfg[0] if isinstance(cfg, list) else cfg, part)
    return cfg[0] if isinstance(cfg, list) else cfg


@pytest.mark.parametrize("key,f,tp,cls", NUMERIC, ids=[k for k, *_ in NUMERIC])
def test_each_range_refuses_just_outside_and_takes_just_inside(key, f, tp, cls):
    valid: Range = f.metadata["range"]
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    assert all(v is None or v in valid for v in (default if isinstance(default, list) else [default]))
    is_int = int in (tp, *typing.get_args(tp))  # int | None too
    outside, inside = _edges(valid, is_int)
    assert outside and inside
    named = f"{key}[0]" if key in ("train.betas", "grpo.reward_weights") else key
    for value in outside if is_int else [*outside, math.nan]:
        with pytest.raises(ConfigError) as e:
            load_config(TINY, _override(key, value), cls)
        assert str(e.value) == f"{named} must be {valid}, got {value if is_int else float(value)!r}"
    for value in inside:
        assert _value(load_config(TINY, _override(key, value), cls), key) == value


def test_negative_lora_alpha_exits_2_with_one_line(run_setup):
    code, out, err = run_setup(RECIPE, "--config", TINY, "lora.enabled=true", "lora.alpha=-1")
    assert code == 2 and out == ""
    assert err == "error: lora.alpha must be > 0, got -1.0\n", err


def test_help_config_into_a_pipe_closed_early_ends_quietly(monkeypatch):
    """`--help-config | head -3` (README): the reader closes the pipe after a few lines; the rest is dropped
    without a BrokenPipeError traceback, and nothing fails at exit's flush."""
    import os
    import stat
    import sys

    from llmtrain.utils import print_piped

    read, write = os.pipe()
    os.close(read)
    out = open(write, "w")
    monkeypatch.setattr(sys, "stdout", out)
    assert stat.S_ISFIFO(os.fstat(write).st_mode)
    print_piped("".join(f"{key}\n" for key, *_ in describe(DPOConfig)) * 200)  # past the pipe's buffer: no raise
    assert os.path.samestat(os.fstat(write), os.stat(os.devnull))  # the rest of the output is dropped
    out.write("more")
    out.flush()  # goes to /dev/null now
    out.close()
