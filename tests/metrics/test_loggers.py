"""The loggers: the log section's keys (log.tensorboard, log.wandb.*, log.peak_tflops) and their checks, and one
real 2-process run with every logger on, read back with each logger's own reader (metrics.jsonl's keys,
TensorBoard's events and its server, wandb's offline run file). The run also exercises the README's
hang-debugging launch: TORCH_DISTRIBUTED_DEBUG=INFO, NCCL_DEBUG and torchrun --log-dir/--redirects/--tee/
--local-ranks-filter (per-rank log files, rank 0 alone on the console)."""

from __future__ import annotations

import importlib.util
import json
import socket
import struct
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import RECIPE, REPO, TINY
from helpers.procs import BIN, finish, read_metrics, start
from llmtrain import metrics as m
from llmtrain.config import ConfigError, describe, load_config, to_yaml


NEW_KEYS = {"tokens_per_sec_per_device", "mfu", "tflops", "step_time_s", "step_time_max_min", "mem_gb",
            "mem_reserved_gb"}
OLD_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "trained_tokens", "skipped_steps", "data_wait_s",
            "elapsed_s"}


def test_logger_check_names_the_key(monkeypatch):
    with pytest.raises(ConfigError, match="log.peak_tflops must be > 0, got 0.0"):  # the range is load_config's
        load_config(TINY, ["log.peak_tflops=0"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"log.wandb.project needs the wandb package: pip install wandb"):
        m.check(load_config(TINY, ["log.wandb.project=p"]).log)
    m.check(load_config(TINY, ["log.tensorboard=true"]).log)


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


def test_logger_extras_are_installable_names():
    """README: pip install -e '.[tensorboard,wandb]' / '.[plot]'; make test installs them through dev."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in ("tensorboard", "wandb", "plot"):
        assert extras[name] and set(extras[name]) <= set(extras["dev"]), name


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
