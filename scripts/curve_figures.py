"""The figures the docs quote for a demo's curve, read from its run's metrics.jsonl (docs/grpo.md's GRPO demo):

    python scripts/curve_figures.py outputs/demo-grpo                    # reward over 50-step windows
    python scripts/curve_figures.py OUTPUT_DIR --key loss --window 25 --ends 5

Prints one line: the key's mean over each window of steps, the first and last windows named, with the mean
over the first and the last `--ends` steps beside them. A resumed run's repeated steps count once (the last
record of a step, as python -m llmtrain.plot reads them). Paste the line into the doc: the figures there are
what this prints, not typed by hand."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmtrain.plot import METRICS_FILE, read_records, series


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def figures(records: list[dict], key: str, window: int, ends: int) -> str:
    steps, values = series(records, key)
    if not steps:
        raise ValueError(f"no {key!r} in the records")
    by_step = dict(zip(steps, values))
    last = int(steps[-1])
    # Windows of whole steps: 1-50, 51-100, ... (a record logged every N steps stands for its step).
    starts = range(1, last + 1, window)
    means = [f"{mean([v for s, v in by_step.items() if a <= s < a + window] or [float('nan')]):.3f}"
             for a in starts]
    head = f"{mean([v for s, v in by_step.items() if s <= ends]):.3f} over steps 1-{ends}"
    tail = f"{mean([v for s, v in by_step.items() if s > last - ends]):.3f} over {last - ends + 1}-{last}"
    means[0] = f"**{means[0]}** (steps 1-{min(window, last)}; {head})"
    if len(means) > 1:
        means[-1] = f"**{means[-1]}** (steps {starts[-1]}-{last}; {tail})"
    return f"`{key}`, mean over {window}-step windows: {', '.join(means)}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("output_dir", type=Path, help="a run's output_dir (holding metrics.jsonl)")
    p.add_argument("--key", default="reward")
    p.add_argument("--window", type=int, default=50, help="steps per window")
    p.add_argument("--ends", type=int, default=10, help="steps of the first and last means beside the windows")
    args = p.parse_args(argv)
    path = args.output_dir / METRICS_FILE
    if not path.is_file():
        print(f"error: no {METRICS_FILE} in {args.output_dir}", file=sys.stderr)
        return 2
    try:
        print(figures(read_records(path), args.key, args.window, args.ends))
    except ValueError as e:
        print(f"error: {path}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
