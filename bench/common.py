"""Helpers shared by bench/run.py and the benchmarks: launching torchrun with a hard timeout (through the launcher
the tests use too, llmtrain/run/launcher.py), reading the recipe's metrics.jsonl, reading this process's memory
counters, small statistics."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # llmtrain, also where it is not installed (TRL's venv)

from llmtrain.run import launcher  # noqa: E402

RECIPE = REPO / "recipes" / "finetune.py"


class BenchError(RuntimeError):
    pass


def base_env(extra: dict | None = None) -> dict:
    """The launcher's environment (one thread per rank, offline, unbuffered), quiet tokenizers and transformers."""
    return {"TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error", **(extra or {})}


def run(cmd: list, timeout: float, env: dict | None = None, log: Path | None = None) -> tuple[str, float]:
    """Run cmd in its own process group (killed whole on timeout); returns (output, wall seconds).
    Raises BenchError with the output's tail on failure."""
    t0 = time.perf_counter()
    try:
        res = launcher.finish(launcher.start(cmd, REPO, base_env(env), merge_stderr=True), timeout)
    except launcher.TimedOut as e:
        raise BenchError(f"{e}\n{e.stdout[-3000:]}") from None
    wall = time.perf_counter() - t0
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(res.stdout)
    if res.returncode != 0:
        raise BenchError(f"exit {res.returncode}: {' '.join(map(str, cmd))}\n{res.stdout[-4000:]}")
    return res.stdout, wall


def torchrun(args: list, nproc: int = 2, timeout: float = 600, env: dict | None = None,
             log: Path | None = None, bindir: Path | None = None) -> tuple[str, float]:
    return run(launcher.command(args, nproc, bindir=bindir), timeout, env, log)


def read_metrics(output_dir: Path) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_records(output_dir: Path) -> list[dict]:
    return [r for r in read_metrics(output_dir) if "tokens_per_sec" in r]


def steady_tokens_per_sec(records: list[dict], warmup_steps: int) -> float:
    """Aggregate rows-x-seq_len tokens/s over the logged windows that start after warmup_steps.
    Every window covers the steps since the previous logged step; windows of equal length carry
    equal token counts, so the aggregate rate is their harmonic mean weighted by window length."""
    prev, tokens, seconds = 0, 0.0, 0.0
    for r in records:
        steps = r["step"] - prev
        if prev >= warmup_steps:
            # tokens_per_sec = window tokens / window seconds; the window's tokens are steps x the step's
            seconds += steps / r["tokens_per_sec"]
            tokens += steps
        prev = r["step"]
    if tokens == 0:
        raise BenchError(f"no logged window after {warmup_steps} warm-up steps")
    return tokens / seconds


def useful_tokens_per_sec(records: list[dict], warmup_steps: int) -> tuple[float, int, float]:
    """Trained (loss-carrying, non-pad) tokens per second after warm-up, from per-step records
    (log.every_steps=1): (rate, tokens, seconds). Time from rank 0's elapsed_s at each logged step."""
    by_step = {r["step"]: r for r in records}
    if warmup_steps not in by_step:
        raise BenchError(f"step {warmup_steps} not logged (log.every_steps must be 1)")
    last = max(by_step)
    tokens = sum(by_step[s]["trained_tokens"] for s in range(warmup_steps + 1, last + 1))
    seconds = by_step[last]["elapsed_s"] - by_step[warmup_steps]["elapsed_s"]
    return tokens / seconds, tokens, seconds


def best_window_rate(ends: list[float], counts: list[float], warmup: int, window: int) -> float:
    """Fastest rate over consecutive windows of `window` steps after `warmup` steps.
    ends[i]: time at the end of step i+1; counts[i]: what step i+1 counted."""
    best = 0.0
    for start in range(warmup, len(ends) - window + 1, window):
        seconds = ends[start + window - 1] - ends[start - 1]
        best = max(best, sum(counts[start:start + window]) / seconds)
    if best == 0.0:
        raise BenchError(f"no full window of {window} steps after {warmup} warm-up steps")
    return best


def median(values: list[float]) -> float:
    return float(statistics.median(values))


# -- memory of this process (Linux) ----------------------------------------------------------------

def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile ... from /proc/self/status, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0]) * 1024
    return out


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def tokenizer_and_config(section):
    """The bundled tokenizer and `section`'s model config, as the recipe loads them (models.build.build_model
    then builds the model)."""
    from llmtrain.models import hf as model_lib

    tokenizer = model_lib.load_tokenizer(str(REPO / "assets" / "tokenizer"), False)
    return tokenizer, model_lib.load_model_config(section, tokenizer)


def pair_order(i: int) -> str:
    """The order of pair i in alternating_pairs."""
    return "A B" if i % 2 == 0 else "B A"


def alternating_pairs(pairs: int, run_a, run_b) -> list[tuple]:
    """[(run_a(i), run_b(i)) for each pair], run in the order A B, B A, A B, ...: load drift and
    first-launch effects touch both sides alike."""
    out = []
    for i in range(pairs):
        if pair_order(i) == "A B":
            a, b = run_a(i), run_b(i)
        else:
            b, a = run_b(i), run_a(i)
        out.append((a, b))
    return out
