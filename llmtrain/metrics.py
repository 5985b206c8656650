"""Per-step metrics: stdout, output_dir/metrics.jsonl and a tqdm bar, written by rank 0 only."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    def __init__(self, output_dir: str, enabled: bool, total_steps: int, start_step: int, progress: bool,
                 append: bool = False):
        self.enabled = enabled
        self.start = time.perf_counter()
        self.file = None
        self.bar = None
        if not enabled:
            return
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self.file = open(Path(output_dir) / METRICS_FILE, "a" if append else "w")
        if progress and sys.stderr.isatty():
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def step(self, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}")

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.info(" ".join(f"{k}={_fmt(v)}" for k, v in record.items()))

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
        if self.file is not None:
            self.file.close()


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)
