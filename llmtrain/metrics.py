"""Per-step metrics: what is measured and where it goes.

Every logged step is one JSON record in output_dir/metrics.jsonl and one line on stdout (rank 0),
and optionally TensorBoard scalars (log.tensorboard) and a Weights & Biases run (log.wandb.project).
Training records carry these keys (evaluation records carry step, val_loss, val_ppl):

    step, loss, lr, grad_norm    the optimizer step; loss is the global token-weighted mean
    trained_tokens               tokens that carried a loss in this step, all ranks
    skipped_steps                non-finite steps skipped so far (train.on_nan=skip)
    data_wait_s                  seconds this step waited for its batch (rank 0)
    elapsed_s                    seconds since this process started logging (after the model was loaded)
    tokens_per_sec               rows x seq_len per second over the steps since the last log, all ranks
                                 (padding included: the rate at which rows go through)
    tokens_per_sec_per_device    tokens_per_sec / number of devices
    tflops                       achieved model TFLOP/s per device (padding excluded; see flops_per_token)
    mfu                          tflops / the device's peak (PEAK_TFLOPS or log.peak_tflops); null if unknown
    step_time_s                  mean seconds per step since the last log on rank 0, data wait excluded
    step_time_max_min            max / min of step_time_s across ranks: a straggler hint (below)
    mem_gb                       peak GiB so far, the max over ranks: CUDA memory allocated by tensors;
                                 on CPU the process's peak resident set size
    mem_reserved_gb              peak GiB held by the CUDA caching allocator (what nvidia-smi sees); null on CPU

Straggler hint: ranks wait for each other in the step's collectives, so a rank that arrives late (its
data is slow, its host stalls) has the shortest step_time_s and the others the longest: a ratio well
above 1 on a steady run means uneven ranks. A uniformly slow step shows in tokens_per_sec and mfu.

Model FLOPs (the "model FLOPs utilization" of the PaLM paper, appendix B), per token processed:

    flops_per_token = 6 * N + 12 * n_layers * d_attn * seq_len

  6 * N        every parameter that takes part in a matmul does a multiply-add (2 FLOPs) per token
               in forward and twice that in backward (input and weight gradients). N counts all
               parameters except the input embedding when it is not tied to the LM head (a lookup
               does no arithmetic; the head's matmul does).
  12 * L*d*S   attention scores QK^T and their product with V: 2 matmuls x 2 FLOPs x d_attn x seq_len
               per token and layer in forward, x3 with backward. d_attn = heads x head_dim (the
               hidden size for Llama); seq_len = data.seq_len, the row, as is customary (causal
               masking is not halved; packed examples attend to less).

  With LoRA (frozen weights), backward still computes activation gradients through every weight
  (2 * N) but weight gradients only for the trained ones (2 * N_trained: adapters, modules_to_save):

    flops_per_token = 4 * N + 2 * N_trained + 12 * n_layers * d_attn * seq_len

  (N includes the adapters; the attention term is unchanged: its backward has no weights. The first
  layer's input gradient, not needed under a frozen embedding, is counted: < 1/L of 2N.)

  mfu = flops_per_token x (non-padding tokens per second) / (devices x peak FLOP/s per device)

Padding is excluded (prompt tokens without a loss are not: they are computed all the same).
Activation checkpointing's recomputation is not counted: it is model, not hardware, FLOPs.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from llmtrain.config import Config, ConfigError, LogConfig, to_dict
from llmtrain.data.formats import IGNORE

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb/llmtrain_run_id"

# Dense (no sparsity) peak TFLOP/s per device from the vendors' data sheets. fp32 is plain FP32
# (PyTorch does not use TF32 for matmuls unless asked). Keys are matched as whole words in
# torch.cuda.get_device_name(), longest first ("A10" does not match "A100" or "A10G").
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "H100": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},  # SXM
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2},
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "L40S": {"bf16": 362.1, "fp16": 362.1, "fp32": 91.6},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
    "MI300X": {"bf16": 1307.4, "fp16": 1307.4, "fp32": 163.4},
}


# -- pure functions -------------------------------------------------------------------------------

def flops_per_token(n_params: int, n_layers: int, attn_dim: int, seq_len: int,
                    untied_input_embedding: int = 0, n_trained: int | None = None) -> float:
    """Model FLOPs (forward + backward) per token: 4 * N + 2 * N_trained + 12 * n_layers * attn_dim * seq_len,
    where N = n_params - untied_input_embedding and N_trained = n_trained (LoRA: the trained parameters, none of
    them a frozen input embedding), or N when None (full fine-tuning: 6N). See the module docstring."""
    n = n_params - untied_input_embedding
    return 4.0 * n + 2.0 * (n if n_trained is None else n_trained) + 12.0 * n_layers * attn_dim * seq_len


def model_flops_per_token(config, n_params: int, seq_len: int, n_trained: int | None = None) -> float:
    """flops_per_token from a transformers config (Llama-style: hidden_size, num_hidden_layers, ...);
    n_trained: the trained parameters when the others are frozen (LoRA), None for full fine-tuning. A
    vision-language model's: its language model's (the text tokens' cost; image tokens run the same layers)."""
    config = config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    untied = 0 if getattr(config, "tie_word_embeddings", False) else config.vocab_size * config.hidden_size
    return flops_per_token(n_params, config.num_hidden_layers, config.num_attention_heads * head_dim, seq_len,
                           untied, n_trained)


def peak_tflops(device_name: str | None, dtype: str) -> float | None:
    """Dense peak TFLOP/s of a device named like torch.cuda.get_device_name(), or None if unknown."""
    if not device_name:
        return None
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if re.search(rf"(?<![\w]){re.escape(key)}(?![\w])", device_name, flags=re.IGNORECASE):
            return PEAK_TFLOPS[key][dtype]
    return None


def mfu(flops_per_tok: float, tokens_per_sec: float, n_devices: int, peak_tflops_per_device: float | None
        ) -> float | None:
    """Model FLOPs utilization in [0, 1]: achieved model FLOP/s over the devices' combined peak."""
    if not peak_tflops_per_device:
        return None
    return flops_per_tok * tokens_per_sec / (n_devices * peak_tflops_per_device * 1e12)


def eta_seconds(done_steps: int, elapsed_s: float, remaining_steps: int) -> float | None:
    """Remaining time at the average pace of the steps done so far (in this process)."""
    if done_steps <= 0:
        return None
    return elapsed_s / done_steps * max(remaining_steps, 0)


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def peak_rss_gb() -> float:
    """Peak resident set size of this process (Linux reports KiB, macOS bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20


def memory_gb(device: torch.device) -> tuple[float, float | None]:
    """(peak allocated, peak reserved) GiB on a CUDA device; (peak RSS, None) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30
    return peak_rss_gb(), None


def device_peak_tflops(device: torch.device, dtype: str, override: float | None) -> tuple[float | None, str]:
    """(peak TFLOP/s per device, where it came from): log.peak_tflops, else the table by GPU name."""
    if override:
        return override, "log.peak_tflops"
    if device.type != "cuda":
        return None, f"{device.type}: no peak known"
    name = torch.cuda.get_device_name(device)
    peak = peak_tflops(name, dtype)
    return peak, f"{name}, {dtype}" if peak else f"{name}: not in the table"


def check(section: LogConfig) -> None:
    """Logger settings that can fail before any process group exists."""
    for on, package, extra in ((section.tensorboard, "tensorboard", "log.tensorboard=true"),
                               (section.wandb.project, "wandb", "log.wandb.project")):
        if on and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{extra} needs the {package} package: pip install {package} "
                              f"(or pip install -e '.[{package}]')")


# -- the logging window (collective) --------------------------------------------------------------

class Throughput:
    """Counts the steps between two logged steps on every rank; collect() turns them into the
    throughput, MFU, step-time and memory keys. collect() is a collective: every rank calls it."""

    def __init__(self, flops_per_tok: float, world_size: int, device: torch.device, pad_id: int | None,
                 peak: float | None, peak_source: str = "", sp_size: int = 1):
        self.flops_per_tok, self.world_size, self.device, self.pad_id = flops_per_tok, world_size, device, pad_id
        self.sp_size = sp_size  # a sequence group's ranks hold the same rows: each counted once
        self.peak, self.peak_source = peak, peak_source
        self.last_tokens_per_sec: float | None = None
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self.start = self.last = now
        self.steps, self.step_time, self.rows_tokens, self.real_tokens = 0, 0.0, 0, 0

    def describe(self) -> str:
        peak = (f"peak {self.peak:g} TFLOP/s per device ({self.peak_source})" if self.peak else
                f"mfu is null ({self.peak_source}; set log.peak_tflops), tflops is reported")
        return f"model FLOPs: {self.flops_per_tok / 1e9:.4g} GFLOP per token (llmtrain/metrics.py) | {peak}"

    def add(self, batches: list[dict[str, torch.Tensor]], step_time: float) -> None:
        """One optimizer step on this rank: its micro-batches and its time (data wait excluded)."""
        now = time.perf_counter()
        rows_tokens = sum(b["input_ids"].numel() for b in batches) * self.world_size // self.sp_size
        self.last_tokens_per_sec = rows_tokens / max(now - self.last, 1e-9)
        self.last = now
        self.steps += 1
        self.step_time += step_time
        self.rows_tokens += rows_tokens
        for b in batches:  # padding: no label and the pad id (a real pad-id token with a label counts)
            real = b["labels"] != IGNORE
            if self.pad_id is not None:
                real |= b["input_ids"] != self.pad_id
            self.real_tokens += int(real.sum())

    def collect(self) -> dict:
        """The window's keys; every rank must call it (two small all-reduces)."""
        now = time.perf_counter()
        seconds = max(now - self.start, 1e-9)
        step_time = self.step_time / max(self.steps, 1)
        mem, reserved = memory_gb(self.device)
        maxes = torch.tensor([step_time, -step_time, mem, reserved or 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        real = torch.tensor([float(self.real_tokens)], dtype=torch.float64, device=self.device)
        dist.all_reduce(real)
        slowest, fastest, mem, reserved_max = maxes.tolist()
        fastest = -fastest
        tokens_per_sec = self.rows_tokens / seconds
        real_per_sec = real.item() / self.sp_size / seconds
        tflops = self.flops_per_tok * real_per_sec / self.world_size / 1e12
        self._reset(now)
        return {
            "tokens_per_sec": tokens_per_sec,
            "tokens_per_sec_per_device": tokens_per_sec / self.world_size,
            "tflops": tflops,
            "mfu": mfu(self.flops_per_tok, real_per_sec, self.world_size, self.peak),
            "step_time_s": step_time,
            "step_time_max_min": slowest / fastest if fastest > 0 else None,
            "mem_gb": mem,
            "mem_reserved_gb": reserved_max if reserved is not None else None,
        }


# -- where records go (rank 0) --------------------------------------------------------------------

def _tag(key: str) -> str:
    """TensorBoard / wandb name: grouped by what it is about."""
    if key.startswith("val_"):
        return f"eval/{key}"
    if key.startswith("mem_"):
        return f"system/{key}"
    if key in ("tokens_per_sec", "tokens_per_sec_per_device", "tflops", "mfu", "step_time_s",
               "step_time_max_min", "data_wait_s", "elapsed_s"):
        return f"perf/{key}"
    return f"train/{key}"


def _scalars(record: dict) -> dict[str, float]:
    return {_tag(k): float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardSink:
    def __init__(self, log_dir: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run logs the steps after its checkpoint again: TensorBoard drops the old ones.
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=start_step + 1 if start_step else None)

    def log(self, record: dict) -> None:
        for tag, value in _scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])
        self.writer.flush()  # a crash or preemption loses nothing already logged

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, section, output_dir: Path, run_config: Config | None, resume: bool):
        import wandb

        id_file = output_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
        self.run = wandb.init(project=section.project, entity=section.entity, name=section.name or output_dir.name,
                              mode=section.mode, dir=str(output_dir),
                              config=to_dict(run_config) if run_config is not None else None, tags=section.tags or None,
                              id=run_id, resume="allow" if run_id else None)
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(self.run.id)  # a resumed training run continues this wandb run

    def log(self, record: dict) -> None:
        self.run.log(_scalars(record), step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()


def keep_steps_up_to(path: Path, step: int) -> None:
    """Before a run resumed at `step` appends: keep only the records of steps <= step, so that the steps it
    logs again (those between its checkpoint and the interruption, training and eval records alike) are in
    the file once, as this run logs them; a torn last line (a run killed while writing it) goes too. Written
    beside and renamed over the file: a crash meanwhile leaves the old file or the new one."""
    if not path.is_file():
        return
    kept = []
    with open(path, "rb") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:  # torn (or not a record): only ever the last line
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
                kept.append(line if line.endswith(b"\n") else line + b"\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(kept))
    os.replace(tmp, path)


class MetricsLogger:
    """stdout, metrics.jsonl, TensorBoard, wandb and the progress bar: rank 0 writes, the others do nothing."""

    def __init__(self, output_dir: str, enabled: bool, total_steps: int, start_step: int, progress: bool,
                 append: bool = False, section: LogConfig | None = None, run_config: Config | None = None):
        self.enabled = enabled
        self.start = time.perf_counter()
        self.total_steps, self.start_step, self.step_count = total_steps, start_step, start_step
        self.steps_start: float | None = None
        self.file = None
        self.bar = None
        self.sinks: list = []
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        if append:
            keep_steps_up_to(out / METRICS_FILE, start_step)
        self.file = open(out / METRICS_FILE, "a" if append else "w")
        if progress and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        if section is not None and section.tensorboard:
            self.sinks.append(TensorBoardSink(out / TENSORBOARD_DIR, start_step))
        if section is not None and section.wandb.project:
            self.sinks.append(WandbSink(section.wandb, out, run_config, resume=append))

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def eta(self) -> float | None:
        if self.steps_start is None:
            return None
        # The first step of a process (warm-up, allocation) is left out of the pace.
        return eta_seconds(self.step_count - self.start_step - 1, time.perf_counter() - self.steps_start,
                           self.total_steps - self.step_count)

    def step(self, loss: float, tokens_per_sec: float | None = None) -> None:
        """Every step, every rank: advances the bar (loss, tokens/s; tqdm shows the ETA)."""
        self.step_count += 1
        if self.steps_start is None:
            self.steps_start = time.perf_counter()
        if self.bar is not None:
            self.bar.update(1)
            postfix = {"loss": f"{loss:.4f}"}
            if tokens_per_sec is not None:
                postfix["tok/s"] = _fmt(tokens_per_sec)
            self.bar.set_postfix(postfix)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        self.file.flush()
        for sink in self.sinks:
            sink.log(record)
        line = " ".join(f"{k}={_fmt(v)}" for k, v in record.items() if k != "step" and v is not None)
        suffix = "" if self.bar is not None else f" | eta {format_duration(self.eta())}"
        self.info(f"step {record.get('step')}/{self.total_steps} {line}{suffix}")

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        if self.file is not None:
            self.file.close()
            self.file = None


def json_safe(value):
    """A record for metrics.jsonl: non-finite floats (a skipped step's loss, a reward function's statistics
    when it returned None for every completion) become null, since JSON has no NaN or Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)
