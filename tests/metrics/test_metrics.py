"""llmtrain.metrics' arithmetic and output: FLOPs per token (full and LoRA), the peak TFLOP/s table and MFU,
throughput over non-padding tokens, the ETA; the progress lines and the terminal's bar; metrics.jsonl after a
resume holds each step once (in process, and after a real run killed with SIGKILL and resumed)."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import sys

import pytest
import torch

from helpers import RECIPE, TINY
from helpers.procs import read_metrics, run_recipe, start, wait_for_step
from llmtrain import metrics as m


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
