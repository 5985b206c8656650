"""Observability and everyday tools: metrics keys and their FLOP/peak arithmetic, the loggers
(jsonl, TensorBoard, wandb offline) read back with their own readers, the progress output, plot,
generate, --help, and every recipe config under configs/ (configs/accelerate/ is test_launch.py's).

The end-to-end tests share one 2-process run (module fixture) that also exercises the README's
hang-debugging launch: TORCH_DISTRIBUTED_DEBUG=INFO, NCCL_DEBUG and torchrun --log-dir/--redirects/--tee/
--local-ranks-filter. Others: a distillation run under fsdp2 prints no FSDP2 warning; a killed and resumed
run's metrics.jsonl holds each step once."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from helpers import RECIPE, REPO, TINY
from helpers.procs import (BIN, finish, launch, losses, read_metrics, run_recipe, run_side_by_side, start,
                           wait_for_step)
from llmtrain import metrics as m
from llmtrain.config import ConfigError, describe, load_config, to_yaml
from llmtrain.data.__main__ import config_class

NEW_KEYS = {"tokens_per_sec_per_device", "mfu", "tflops", "step_time_s", "step_time_max_min", "mem_gb",
            "mem_reserved_gb"}
OLD_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "trained_tokens", "skipped_steps", "data_wait_s",
            "elapsed_s"}
NOT_LLMTRAIN_CONFIG_DIRS = {"accelerate"}  # configs/accelerate/: accelerate's own launcher files


# -- pure functions ---------------------------------------------------------------------------------

def test_flops_per_token_formula():
    # Llama-3.1-8B: 8.03e9 parameters (untied: the 128256 x 4096 input embedding does no matmul).
    n, vocab, hidden, layers, seq = 8_030_261_248, 128_256, 4096, 32, 8192
    expected = 6 * (n - vocab * hidden) + 12 * layers * hidden * seq
    assert m.flops_per_token(n, layers, hidden, seq, vocab * hidden) == expected
    assert 55e9 < expected < 60e9  # 6 x 7.5e9 (non-embedding) + 12.9e9 attention

    from transformers import LlamaConfig

    kw = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2)
    tied, untied = LlamaConfig(tie_word_embeddings=True, **kw), LlamaConfig(tie_word_embeddings=False, **kw)
    assert m.model_flops_per_token(tied, 10_000, 32) == 6 * 10_000 + 12 * 3 * 64 * 32
    assert m.model_flops_per_token(untied, 10_000, 32) == 6 * (10_000 - 100 * 64) + 12 * 3 * 64 * 32
    # A head_dim that is not hidden/heads: the attention term uses heads x head_dim.
    wide = LlamaConfig(tie_word_embeddings=True, head_dim=32, **kw)
    assert m.model_flops_per_token(wide, 10_000, 32) == 6 * 10_000 + 12 * 3 * (4 * 32) * 32
    # LoRA: activation gradients through all N, weight gradients for the trained 500 only; the frozen untied
    # input embedding still does no arithmetic.
    assert m.model_flops_per_token(tied, 10_000, 32, 500) == 4 * 10_000 + 2 * 500 + 12 * 3 * 64 * 32
    assert m.model_flops_per_token(untied, 10_000, 32, 500) == 4 * (10_000 - 100 * 64) + 2 * 500 + 12 * 3 * 64 * 32
    # Llama-3.1-8B with r=16 on all linear layers (42M trained): two thirds of full fine-tuning's matmul FLOPs.
    lora = m.flops_per_token(n, layers, hidden, seq, vocab * hidden, 41_943_040)
    assert lora - 12 * layers * hidden * seq == pytest.approx(4 / 6 * (expected - 12 * layers * hidden * seq), rel=0.01)


@pytest.mark.parametrize("name,dtype,peak", [
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 PCIe", "bf16", 756.0),
    ("NVIDIA H200", "fp16", 989.4),
    ("NVIDIA L40S", "bf16", 362.1),
    ("NVIDIA A10", "bf16", 125.0),
    ("AMD Instinct MI300X", "bf16", 1307.4),
    ("NVIDIA A10G", "bf16", None),       # not an A10: unknown rather than wrong
    ("NVIDIA GeForce RTX 4090", "bf16", None),
    (None, "bf16", None),
])
def test_peak_tflops_table(name, dtype, peak):
    assert m.peak_tflops(name, dtype) == peak


def test_mfu_and_device_peak():
    assert m.mfu(1e9, 1e5, 2, 100.0) == pytest.approx(0.5)  # 1e14 FLOP/s over 2 x 100 TFLOP/s
    assert m.mfu(1e9, 1e5, 2, None) is None
    assert m.device_peak_tflops(torch.device("cpu"), "bf16", None)[0] is None
    assert m.device_peak_tflops(torch.device("cpu"), "bf16", 123.0) == (123.0, "log.peak_tflops")


def test_throughput_counts_non_padding_tokens():
    pad, ignore = 0, -100
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 2, 0, 0, 0],      # prompt 5 6, answer 7 8, eos 2, 3 pads
                                        [9, 9, 9, 9, 9, 9, 0, 2]]),   # a pad-id token with a label counts
             "labels": torch.tensor([[ignore, ignore, 7, 8, 2, ignore, ignore, ignore],
                                     [ignore, 9, 9, 9, 9, 9, 0, 2]])}
    t = m.Throughput(flops_per_tok=100.0, world_size=2, device=torch.device("cpu"), pad_id=pad, peak=None)
    t.add([batch, batch], step_time=0.5)
    assert t.real_tokens == 2 * (5 + 8) and t.rows_tokens == 2 * 16 * 2 and t.steps == 1
    assert t.last_tokens_per_sec > 0 and "mfu is null" in t.describe()


def test_eta_and_duration():
    assert m.eta_seconds(0, 5.0, 10) is None
    assert m.eta_seconds(4, 8.0, 10) == 20.0
    assert m.format_duration(3725) == "1:02:05" and m.format_duration(None) == "?"


def test_logger_check_names_the_key(monkeypatch):
    with pytest.raises(ConfigError, match="log.peak_tflops must be > 0, got 0.0"):  # the range is load_config's
        load_config(TINY, ["log.peak_tflops=0"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"log.wandb.project needs the wandb package: pip install wandb"):
        m.check(load_config(TINY, ["log.wandb.project=p"]).log)
    m.check(load_config(TINY, ["log.tensorboard=true"]).log)


# -- config keys, --help, configs/ ------------------------------------------------------------------

def test_log_section_keys_nest_and_round_trip(tmp_path):
    cfg = load_config(TINY, ["log.wandb.project=p", "log.wandb.mode=offline", "log.wandb.tags=[a,b]",
                             "log.tensorboard=true", "log.peak_tflops=989"])
    assert (cfg.log.wandb.project, cfg.log.wandb.mode, cfg.log.wandb.tags) == ("p", "offline", ["a", "b"])
    assert cfg.log.tensorboard is True and cfg.log.peak_tflops == 989.0
    (tmp_path / "c.yaml").write_text(to_yaml(cfg))
    assert load_config(tmp_path / "c.yaml") == cfg
    with pytest.raises(ConfigError, match="did you mean 'log.wandb.project'"):
        load_config(TINY, ["log.wandb.projetc=p"])
    with pytest.raises(ConfigError, match="log.wandb.mode"):
        load_config(TINY, ["log.wandb.mode=sometimes"])
    rows = {r[0]: r for r in describe()}
    for key in ("log.tensorboard", "log.peak_tflops", "log.wandb.project", "log.wandb.mode", "log.wandb.entity",
                "log.wandb.name", "log.wandb.tags"):
        assert rows[key][3], key  # every key has a description for --help-config


@pytest.mark.slow
def test_help_explains_usage():
    helps = [subprocess.Popen([sys.executable, RECIPE, flag], stdout=subprocess.PIPE, text=True)  # side by side
             for flag in ("--help", "--help-config")]
    text, config = (proc.communicate(timeout=120)[0] for proc in helps)
    assert [proc.returncode for proc in helps] == [0, 0]
    for words in ("torchrun --nproc_per_node=N recipes/finetune.py --config", "--help-config", "--print-config",
                  "metrics.jsonl", "python -m llmtrain.plot", "python -m llmtrain.tools.generate",
                  "python -m llmtrain.convert"):
        assert words in text, words
    lines = config.splitlines()
    assert any(line.startswith("log.wandb.project ") and "None" in line for line in lines)


def _config_files() -> list[Path]:
    return sorted(p for p in (REPO / "configs").rglob("*")
                  if p.suffix in (".yaml", ".yml")
                  and not NOT_LLMTRAIN_CONFIG_DIRS & set(p.relative_to(REPO / "configs").parts))


def test_configs_cover_the_use_cases():
    names = {p.name for p in _config_files()}
    assert {"demo.yaml", "smollm2-360m-ddp.yaml", "llama3.2-1b-fsdp2.yaml", "llama3.2-3b-fsdp2.yaml",
            "llama3.1-8b-multinode.yaml", "chat-sft-llama3.1-8b.yaml", "cpt-llama3.2-1b-text.yaml"} <= names


@pytest.mark.parametrize("path", _config_files(), ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_config_file_is_valid_and_documented(path):
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    text = "\n".join(header)
    # types, choices, cross-field checks (with the Config of the recipe the header launches); no weights or data read
    cfg = load_config(path, cls=config_class(str(path), []))  # the recipe's config by its own section (dpo:)
    assert len(header) >= 3 and "Hardware:" in text and "Memory:" in text, f"{path.name}: comment header"
    assert f"configs/{path.relative_to(REPO / 'configs')}" in text, f"{path.name}: the header shows how to launch it"
    assert Path(cfg.output_dir).parts[0] == "outputs"


# -- progress output --------------------------------------------------------------------------------

def test_plain_lines_have_progress_and_eta(tmp_path, capsys):
    log = m.MetricsLogger(str(tmp_path), True, total_steps=4, start_step=0, progress=True)
    for step in (1, 2):
        log.step(3.0, tokens_per_sec=1000.0)
    log.log({"step": 2, "loss": 3.0, "mfu": None, "tflops": 0.5})
    log.log({"step": 2, "val_loss": 2.5})
    log.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 2/4 loss=3 tflops=0.5 | eta 0:00:0"), out  # null values are not printed
    assert out[1].startswith("step 2/4 val_loss=2.5"), out
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][0]["mfu"] is None


def test_progress_bar_in_a_terminal(tmp_path, monkeypatch, capsys):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    log = m.MetricsLogger(str(tmp_path), True, total_steps=10, start_step=2, progress=True)
    log.step(2.5, tokens_per_sec=12345.0)
    log.log({"step": 3, "loss": 2.5})
    log.close()
    bar = term.getvalue()
    assert "3/10" in bar and "loss=2.5000" in bar and "tok/s=12345" in bar and "<" in bar, bar  # "<" = ETA
    # Records still go to stdout (through the bar's write, so the bar stays at the bottom); the bar has the ETA.
    assert capsys.readouterr().out == "step 3/10 loss=2.5\n"


# -- plot -------------------------------------------------------------------------------------------

def test_plot_mixed_train_and_eval_records(tmp_path):
    from llmtrain import plot

    records = [{"step": s, "loss": 5 / s, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 1000.0, "mfu": None,
                "tflops": 0.1} for s in range(1, 11)]
    records += [{"step": s, "val_loss": 6 / s, "val_ppl": 2.0} for s in (5, 10)]
    records.append({"step": 10, "loss": 0.4})  # a resumed run logs the step again: the last one wins
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)) + '\n{"step": 11, "lo')
    steps, losses = plot.series(plot.read_records(tmp_path / "metrics.jsonl"), "loss")
    assert steps == list(range(1, 11)) and losses[-1] == 0.4
    assert plot.series(plot.read_records(tmp_path / "metrics.jsonl"), "val_loss") == ([5, 10], [1.2, 0.6])
    assert plot.main([str(tmp_path)]) == 0
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert plot.main([str(tmp_path / "nowhere")]) == 2


BASE_RECORD = {"loss": 0.7, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 1000.0, "mfu": None, "tflops": 0.1,
               "trained_tokens": 400, "skipped_steps": 0, "data_wait_s": 0.0, "elapsed_s": 3.0,
               "tokens_per_sec_per_device": 500.0, "step_time_s": 0.1, "step_time_max_min": 1.1, "mem_gb": 0.6,
               "mem_reserved_gb": None}
DPO_KEYS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected"]
# What recipes/grpo.py logs (its docstring's list) with two reward functions and grpo.beta > 0.
GRPO_KEYS = ["reward", "reward_std", "rewards/format_regex/mean", "rewards/format_regex/std", "rewards/exact/mean",
             "rewards/exact/std", "frac_reward_zero_std", "kl", "completions/mean_length",
             "completions/min_length", "completions/max_length", "completions/clipped_ratio",
             "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
             "clip_ratio/region_mean", "generation_s", "generated_tokens_per_s"]


def write_records(tmp_path, records):
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)) + "\n")
    return plot_panels(tmp_path)


def plot_panels(tmp_path):
    from llmtrain import plot

    return [tuple(p) for p in plot.panels(plot.read_records(tmp_path / "metrics.jsonl"))]


def test_plot_panels_follow_the_keys_of_any_recipe(tmp_path, capsys):
    from llmtrain import plot

    records = [{"step": s, **BASE_RECORD, **{k: s / 10 for k in DPO_KEYS}} for s in range(1, 9)]
    records += [{"step": s, "val_loss": 0.6, "val_ppl": 1.8, **{f"val_{k}": 0.5 for k in DPO_KEYS},
                 "val_custom": 3.0, "harness/arc_easy/acc": 0.4, "harness/arc_easy/acc_norm": 0.45,
                 "harness/hellaswag/acc": 0.3} for s in (4, 8)]
    assert write_records(tmp_path, records) == [
        ("Preference accuracy (DPO)", ["rewards/accuracies", "val_rewards/accuracies"]),
        ("Implicit rewards (DPO)", ["rewards/chosen", "rewards/rejected", "rewards/margins", "val_rewards/chosen",
                                    "val_rewards/rejected", "val_rewards/margins"]),
        ("Log-probs (DPO)", ["logps/chosen", "logps/rejected", "val_logps/chosen", "val_logps/rejected"]),
        ("Harness scores", ["harness/arc_easy/acc", "harness/arc_easy/acc_norm", "harness/hellaswag/acc"]),
        ("Perplexity", ["val_ppl"]),
        ("custom", ["val_custom"]),
    ]
    assert plot.panels([{"step": 1, **BASE_RECORD}]) == []  # finetune: the four fixed ones
    assert plot.main([str(tmp_path)]) == 0
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 60_000  # 10 panels
    with pytest.raises(SystemExit):
        plot.main(["--help"])
    assert "run logs the steps after its checkpoint again, and the last record of a step wins.\n\n" in \
        capsys.readouterr().out  # the whole description, not its first line


def test_plot_draws_every_key_grpo_logs_under_its_own_titles(tmp_path):
    from llmtrain import plot

    records = [{"step": s, **BASE_RECORD, **{k: s / 10 for k in GRPO_KEYS}, "my_func/hits": 1.0,
                "my_func/misses": 2.0, "entropy": 0.5} for s in range(1, 5)]
    assert write_records(tmp_path, records) == [
        ("Rewards: total and per function (GRPO)", ["reward", "reward_std", "rewards/format_regex/mean",
                                                    "rewards/format_regex/std", "rewards/exact/mean",
                                                    "rewards/exact/std"]),
        ("Groups with zero reward std, truncated completions (GRPO)",
         ["frac_reward_zero_std", "completions/clipped_ratio"]),
        ("Completion length, tokens (GRPO)",
         ["completions/mean_length", "completions/min_length", "completions/max_length"]),
        ("Clipped token fraction (GRPO)", ["clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean",
                                           "clip_ratio/high_max", "clip_ratio/region_mean"]),
        ("KL to the reference", ["kl"]),
        ("Generation seconds per step (GRPO)", ["generation_s"]),
        ("Generated tokens/s (GRPO)", ["generated_tokens_per_s"]),
        ("my_func/*", ["my_func/hits", "my_func/misses"]),  # a key no recipe here logs: by its prefix
        ("entropy", ["entropy"]),
    ]
    drawn = {k for _, keys in plot.panels(records) for k in keys}
    assert set(records[0]) - drawn - plot.FIXED - plot.BOOKKEEPING == {"step"}  # nothing left out
    assert plot.main([str(tmp_path)]) == 0


def test_a_resumed_run_keeps_each_step_once(tmp_path):
    """Resumed at step 3 (its checkpoint) after logging steps 4-5 and an eval at 4: the records of steps > 3
    (training and eval) are dropped before the resumed run logs those steps again, so each is there once, the
    resumed run's; so is a torn last line. A fresh run (no resume) starts the file over."""
    from llmtrain import plot

    path = tmp_path / m.METRICS_FILE
    old = [{"step": s, "loss": 5.0 - s} for s in (1, 2)] + [{"step": 2, "val_loss": 4.5}, {"step": 3, "loss": 2.0}]
    stale = [{"step": 4, "loss": 1.0}, {"step": 4, "val_loss": 3.5}, {"step": 5, "loss": 0.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in old + stale) + '{"step": 6, "lo')
    logger = m.MetricsLogger(str(tmp_path), True, 10, 3, False, append=True)
    new = [{"step": 4, "loss": 1.25}, {"step": 4, "val_loss": 3.25}, {"step": 5, "loss": 0.75}]
    for r in new:
        logger.log(r)
    logger.close()
    assert read_metrics(tmp_path) == old + new
    assert plot.series(plot.read_records(path), "loss") == ([1, 2, 3, 4, 5], [4.0, 3.0, 2.0, 1.25, 0.75])
    assert not (tmp_path / (m.METRICS_FILE + ".tmp")).exists()
    m.MetricsLogger(str(tmp_path), True, 10, 0, False).close()
    assert path.read_text() == ""


# -- one real 2-process run with every logger on ----------------------------------------------------

@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    out = tmp_path_factory.mktemp("observed")
    logs = out / "torchrun_logs"
    proc = start([RECIPE, "--config", TINY, f"output_dir={out}", "parallel.strategy=ddp", "log.every_steps=2",
                  "log.tensorboard=true", "log.wandb.project=llmtrain-test", "eval.every_steps=2",
                  "data.val_fraction=0.1"],
                 nproc=2, env={"WANDB_MODE": "offline", "TORCH_DISTRIBUTED_DEBUG": "INFO", "NCCL_DEBUG": "INFO"},
                 torchrun_args=("--log-dir", str(logs), "--redirects", "3", "--tee", "3",
                                "--local-ranks-filter", "0"))
    res = finish(proc, timeout=240)
    if res.returncode != 0:
        pytest.fail(f"exit {res.returncode}\n--- stdout\n{res.stdout[-4000:]}\n--- stderr\n{res.stderr[-6000:]}")
    return out, res


@pytest.mark.slow
def test_metrics_have_every_key(observed):
    out, _ = observed
    records = read_metrics(out)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in train] == [2, 4] and [r["step"] for r in evals] == [2, 4]
    for r in train:
        assert OLD_KEYS | NEW_KEYS <= r.keys(), sorted(r)
        assert r["mfu"] is None and r["mem_reserved_gb"] is None  # CPU: no peak known, no CUDA allocator
        assert r["tflops"] > 0 and r["step_time_s"] > 0 and r["step_time_max_min"] >= 1.0
        assert r["tokens_per_sec_per_device"] == pytest.approx(r["tokens_per_sec"] / 2)
        assert 0.05 < r["mem_gb"] < 20  # peak RSS of the larger rank, in GiB


@pytest.mark.slow
def test_tensorboard_events_read_back(observed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = observed
    event_files = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert len(event_files) == 1, event_files  # rank 0 only
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "eval/val_loss", "perf/tokens_per_sec", "perf/tflops", "system/mem_gb"} <= tags
    assert "perf/mfu" not in tags  # null on CPU: not written
    jsonl = {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}
    assert {e.step: e.value for e in acc.Scalars("train/loss")} == pytest.approx(jsonl)


def _wandb_records(path: Path):
    """Records of a .wandb file: a header, then LevelDB log blocks (32 KiB; 7-byte chunk headers) of
    protobuf Records (what `wandb sync` uploads)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, buf = path.read_bytes(), 32768, 7, b""
    assert data.startswith(b":W&B")
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


@pytest.mark.slow
def test_wandb_offline_run(observed):
    out, _ = observed
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs  # rank 0 only
    (run_file,) = runs[0].glob("run-*.wandb")
    assert (runs[0] / "files").is_dir() and (runs[0] / "logs").is_dir()
    assert (out / m.WANDB_ID_FILE).read_text() in run_file.name
    history, project = {}, None
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            project = record.run.project
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            if "train/loss" in items:
                history[items["_step"]] = items["train/loss"]
    assert project == "llmtrain-test"
    assert history == pytest.approx({r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r})


@pytest.mark.slow
def test_per_rank_logs_and_filtered_console(observed):
    out, res = observed
    (attempt,) = (out / "torchrun_logs").glob("*/attempt_0")
    for rank in (0, 1):
        assert (attempt / str(rank) / "stdout.log").is_file() and (attempt / str(rank) / "stderr.log").is_file()
    assert "step 4/4 loss=" in (attempt / "0" / "stdout.log").read_text()
    assert "[default0]:" in res.stdout and "[default1]:" not in res.stdout + res.stderr


@pytest.mark.slow
def test_plot_cli(observed, tmp_path):
    out, _ = observed
    res = launch(["-m", "llmtrain.plot", out, "--out", tmp_path / "c.png"], torchrun=False, timeout=120)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_generate_cli_matches_transformers(observed):
    from llmtrain.tools import generate

    out, _ = observed
    res = launch(["-m", "llmtrain.tools.generate", "--model", out / "hf", "--prompt", "Hello there", "--chat",
                  "--max-new-tokens", "8"], torchrun=False, timeout=120)
    assert res.returncode == 0, res.stderr
    model, tok = generate.load(str(out / "hf"), "cpu")
    inputs = generate.build_inputs(tok, "Hello there", chat=True)
    prompt = tok.decode(inputs["input_ids"][0])
    assert "<|start_header_id|>user<|end_header_id|>" in prompt and prompt.endswith("assistant<|end_header_id|>\n\n")
    assert res.stdout == generate.generate(model, tok, "Hello there", chat=True, max_new_tokens=8) + "\n"
    # A chat reply ends with its turn: the template's end-of-turn token stops generation, not only EOS.
    eot, eos = tok.convert_tokens_to_ids("<|eot_id|>"), tok.eos_token_id
    assert eot != eos and {eot, eos} <= set(generate.stop_token_ids(model, tok))
    assert {eot, eos} <= set(model.generation_config.eos_token_id)  # the export itself says where a turn ends
    plain = generate.generate(model, tok, "Hello there", max_new_tokens=8)
    ids = tok(plain, add_special_tokens=False)["input_ids"]
    assert 0 < len(ids) <= 8 or plain == ""
    assert generate.main(["--model", str(out), "--prompt", "x"]) == 2  # not a model directory
    assert generate.main(["--model", str(out / "hf"), "--prompt", "Hello there", "--max-new-tokens", "8"]) == 0


@pytest.mark.slow
def test_bring_your_own_model_and_data(observed, tmp_path):
    """The README's example: fine-tune an exported Hugging Face model (model.path) on chat data."""
    out, _ = observed
    run_recipe(tmp_path, "parallel.strategy=none", "model.config=null", f"model.path={out / 'hf'}",
               "tokenizer.path=null", "data.path=data/demo/chat.jsonl", "data.format=chat", "data.seq_len=64",
               "train.max_steps=2", "log.every_steps=1", config=REPO / "configs" / "demo.yaml", torchrun=False)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2] and all(r["loss"] < 7 for r in records)
    assert (tmp_path / "hf" / "model.safetensors").is_file()


@pytest.mark.slow
def test_tensorboard_cli_serves_the_run(observed):
    out, _ = observed
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(BIN / "tensorboard"), "--logdir", str(out / "tensorboard"), "--host", "127.0.0.1",
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline, tags = time.monotonic() + 60, {}
        while time.monotonic() < deadline and not tags:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=5) as r:
                    tags = json.load(r)
            except OSError:
                time.sleep(0.3)
        assert "train/loss" in next(iter(tags.values()), {}), tags
    finally:
        proc.kill()
        proc.communicate()


def test_logger_extras_are_installable_names():
    """README: pip install -e '.[tensorboard,wandb]' / '.[plot]'; make test installs them through dev."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in ("tensorboard", "wandb", "plot"):
        assert extras[name] and set(extras[name]) <= set(extras["dev"]), name


# -- what a distillation run prints ------------------------------------------------------------------

@pytest.mark.slow
def test_distill_under_fsdp2_prints_no_view_warning(tmp_path, base):
    """FSDP2 warned once per rank that the student's forward "returned a view tensor" (the KD loss, a view of
    the chunked sums): gone from a 2-rank fsdp2 run's output, whose losses are the 1-process run's."""
    from helpers.distill import DISTILL, distill_args

    runs = {"fsdp2": (tmp_path / "fsdp2", 2, distill_args(base, "parallel.strategy=fsdp2", "train.micro_batch_size=1",
                                                           "train.grad_accum_steps=2"), DISTILL),
            "none": (tmp_path / "none", 1, distill_args(base, "parallel.strategy=none"), DISTILL)}
    res = run_side_by_side(runs, at_once=2)
    for name, r in res.items():
        assert "view tensor" not in r.stdout + r.stderr, (name, r.stderr[-3000:])
    assert losses(tmp_path / "fsdp2") == pytest.approx(losses(tmp_path / "none"), abs=2e-5)


@pytest.mark.slow
def test_a_killed_and_resumed_run_logs_each_step_once(tmp_path):
    """kill -9 after the steps past its checkpoint were logged (training and eval records), then resumed: every
    step's records are in metrics.jsonl once, the checkpoint's steps as first logged and the later ones as the
    resumed run logs them; plot reads it."""
    from llmtrain import plot
    from llmtrain.checkpoint import complete_checkpoints

    args = ("checkpoint.every_steps=4", "eval.every_steps=1", "data.val_fraction=0.1", "train.lr_schedule=constant")
    proc = start([RECIPE, "--config", TINY, f"output_dir={tmp_path}", "train.max_steps=1000", *args])
    wait_for_step(tmp_path, 6, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    (saved, _), *_ = complete_checkpoints(tmp_path / "checkpoints")[::-1]
    before = read_metrics(tmp_path)
    last = max(r["step"] for r in before)
    assert saved < last, (saved, last)  # steps logged past the checkpoint: the resumed run logs them again
    res = run_recipe(tmp_path, f"train.max_steps={last + 1}", *args)
    assert f"resumed at step {saved}" in res.stdout
    after = read_metrics(tmp_path)
    assert [r for r in after if r["step"] <= saved] == [r for r in before if r["step"] <= saved]
    steps = list(range(1, last + 2))
    assert [r["step"] for r in after if "loss" in r] == steps and [r["step"] for r in after if "val_loss" in r] == steps
    printed = {int(step): loss for step, loss in re.findall(r"(?m)^step (\d+)/\d+ loss=(\S+)", res.stdout)}
    assert {r["step"]: f"{r['loss']:.4g}" for r in after if "loss" in r and r["step"] > saved} == printed
    assert plot.series(plot.read_records(tmp_path / "metrics.jsonl"), "loss")[0] == steps
    assert plot.main([str(tmp_path)]) == 0
