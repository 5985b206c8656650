"""A collective that timed out, said plainly. Gloo's own error names neither the collective nor the code that
called it ("Timed out waiting 600000ms for recv operation to complete"); its traceback knows both: the first
torch.distributed function entered is the collective, the frame before it the call site."""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import torch

GLOO_TIMEOUT = re.compile(r"Timed out waiting (\d+) ?ms for (?:send|recv) operation")
TORCH = Path(torch.__file__).resolve().parent
WRAPPERS = {"wrapper"}  # torch.distributed.c10d_logger's decorator around every collective
HELPERS = Path(__file__).resolve().with_name("distributed.py")  # llmtrain's collectives: the site is their caller


def describe(e: BaseException) -> str | None:
    """One line for a collective's timeout: which collective, called where, after how long, and what it means;
    None for any other error."""
    found = GLOO_TIMEOUT.search(str(e))
    if not found:
        return None
    frames = traceback.extract_tb(e.__traceback__)
    inside = [_is_torch(f.filename) for f in frames]
    first = next((i for i, f in enumerate(frames) if inside[i] and "/distributed/" in f.filename
                  and f.name not in WRAPPERS), None)
    ours = [i for i in range(len(frames) if first is None else first) if not inside[i]]
    if first is not None:
        what = f"collective {frames[first].name}"
    else:  # entered from inside torch, e.g. DDP's gradient all-reduce in backward
        what = f"a collective inside {frames[-1].name if frames else 'torch'}"
    callers = [i for i in ours if Path(frames[i].filename).resolve() != HELPERS] or ours
    where = f", called at {_site(frames[callers[-1]])}" if ours else ""
    return (f"{what} timed out after {int(found.group(1)) / 1000:g} s (distributed.timeout_s){where}: another rank "
            "did not reach it (stuck, or died: its own error line and errors-rank<R>.log say why)")


def _is_torch(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(TORCH)


def _site(frame: traceback.FrameSummary) -> str:
    path = Path(frame.filename).resolve()
    try:
        path = path.relative_to(Path.cwd())
    except ValueError:
        pass
    return f"{path}:{frame.lineno} ({frame.name})"
