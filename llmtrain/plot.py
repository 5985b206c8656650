"""Training curves from a run's metrics.jsonl, in one PNG.

    python -m llmtrain.plot OUTPUT_DIR [--out curves.png]      # default: OUTPUT_DIR/curves.png

Always: loss and val_loss, learning rate, throughput (tokens/s, MFU or TFLOP/s) and gradient norm. Then a
panel for every other key the file holds, whichever recipe wrote it: a known key on its recipe's panel (PANELS:
DPO's implicit rewards and log-probs, GRPO's rewards, completion lengths, clipped ratios and generation time,
harness/<task>/<metric> scores, perplexity), any other with the keys that share its prefix (`name/...`), or
alone. A key's validation curve (val_<key>) is dashed on its panel. The run's bookkeeping (BOOKKEEPING: step
times, memory, token counts) stays in the file.

Training records (loss, ...) and evaluation records (val_loss, ...) may come in any mix; a resumed
run logs the steps after its checkpoint again, and the last record of a step wins."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import sys
from pathlib import Path
from typing import NamedTuple

METRICS_FILE = "metrics.jsonl"  # llmtrain.metrics.METRICS_FILE (not imported: no torch needed here)

FIXED = {"loss", "lr", "tokens_per_sec", "mfu", "tflops", "grad_norm"}  # the four fixed panels' keys
BOOKKEEPING = {"trained_tokens", "skipped_steps", "data_wait_s", "elapsed_s", "tokens_per_sec_per_device",
               "step_time_s", "step_time_max_min", "mem_gb", "mem_reserved_gb"}
# The panels of the keys recipes log, in the order drawn: (title, a pattern a key fully matches); a key goes to
# the first panel that matches it, and val_<key> goes with <key>.
PANELS = (
    ("Preference accuracy (DPO)", r"rewards/accuracies"),
    ("Implicit rewards (DPO)", r"rewards/[^/]+"),
    ("Log-probs (DPO)", r"logps/.+"),
    ("Rewards: total and per function (GRPO)", r"reward|reward_std|rewards/.+/.+"),
    ("Groups with zero reward std, truncated completions (GRPO)", r"frac_reward_zero_std|completions/clipped_ratio"),
    ("Completion length, tokens (GRPO)", r"completions/.+"),
    ("Clipped token fraction (GRPO)", r"clip_ratio/.+"),
    ("KL to the reference", r"kl"),
    ("Generation seconds per step (GRPO)", r"generation_s"),
    ("Generated tokens/s (GRPO)", r"generated_tokens_per_s"),
    ("Harness scores", r"harness/.+"),
    ("Perplexity", r"ppl"),
)


def read_records(path: Path) -> list[dict]:
    """Records of a metrics.jsonl; a torn last line (a run still writing) is skipped."""
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), (int, float)):
            records.append(record)
    return records


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of `key`, sorted by step, the last value of each step, nulls left out."""
    by_step = {}
    for r in records:
        value = r.get(key)
        if _number(value):
            by_step[r["step"]] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def _last(values: list[float]) -> str:
    return f"{values[-1]:.4g}" if values else "-"


class Panel(NamedTuple):
    title: str
    keys: list[str]  # in the file's order, training keys before validation (val_) ones


def _title(key: str) -> str:
    """A key's panel: the first of PANELS it matches, else its prefix's (`name/*`), else its own."""
    title = next((title for title, pattern in PANELS if re.fullmatch(pattern, key)), None)
    return title or (f"{key.split('/')[0]}/*" if "/" in key else key)


def panels(records: list[dict]) -> list[Panel]:
    """A panel for every key the records have numbers for, but the fixed panels' and the bookkeeping: PANELS
    first, in their order, then the others in the file's order."""
    found: dict[str, list[str]] = {}
    for key in dict.fromkeys(k for r in records for k, v in r.items() if _number(v) and k != "step"):
        base = key.removeprefix("val_")
        if base not in FIXED | BOOKKEEPING:
            found.setdefault(_title(base), []).append(key)
    known = [title for title, _ in PANELS if title in found]
    order = known + [t for t in found if t not in known]
    return [Panel(t, sorted(found[t], key=lambda k: k.startswith("val_"))) for t in order]


def plot(records: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    extra = panels(records)
    rows = math.ceil((4 + len(extra)) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(13, 4 * rows), constrained_layout=True, squeeze=False)
    ax_loss, ax_lr, ax_tput, ax_grad, *ax_extra = axes.flat
    fig.suptitle(title, fontsize=13)
    loss_panel(ax_loss, records)
    line_panel(ax_lr, records, "lr", "Learning rate", "tab:green", 1.6)
    if series(records, "lr")[1]:
        ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    throughput_panel(ax_tput, records)
    line_panel(ax_grad, records, "grad_norm", "Gradient norm (before clipping)", "tab:brown", 1.4)
    for ax, panel in zip(ax_extra, extra):
        recipe_panel(ax, records, panel)
    if len(ax_extra) > len(extra):  # an odd number of panels
        ax_extra[-1].set_visible(False)

    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in metrics.jsonl", ha="center", va="center", transform=ax.transAxes, color="gray")


def loss_panel(ax, records: list[dict]) -> None:
    """Train loss and, where logged, val loss (its best in the legend)."""
    steps, loss = series(records, "loss")
    vsteps, vloss = series(records, "val_loss")
    if loss:
        ax.plot(steps, loss, color="tab:blue", lw=1.6, label=f"train loss (last {_last(loss)})")
    if vloss:
        ax.plot(vsteps, vloss, color="tab:orange", lw=1.6, marker="o", ms=4,
                label=f"val loss (last {_last(vloss)}, best {min(vloss):.4g})")
    if loss or vloss:
        ax.legend(loc="upper right")
    else:
        _empty(ax, "loss")
    ax.set_title("Loss")


def line_panel(ax, records: list[dict], key: str, title: str, color: str, lw: float) -> None:
    """One metric as a line, or a note that it was not logged."""
    steps, values = series(records, key)
    if values:
        ax.plot(steps, values, color=color, lw=lw)
    else:
        _empty(ax, key)
    ax.set_title(title)


def throughput_panel(ax, records: list[dict]) -> None:
    """tokens/s on the left axis; MFU (or, without a known peak, TFLOP/s per device) on the right."""
    steps, tps = series(records, "tokens_per_sec")
    ax.set_title("Throughput")
    if not tps:
        _empty(ax, "tokens_per_sec")
        return
    msteps, mfu = series(records, "mfu")
    fsteps, tflops = series(records, "tflops")
    ax.plot(steps, tps, color="tab:purple", lw=1.6, label=f"tokens/s, all devices (last {_last(tps)})")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("tokens/s")
    twin = ax.twinx()
    if mfu:
        twin.plot(msteps, [100 * m for m in mfu], color="tab:red", lw=1.2, ls="--",
                  label=f"MFU % (last {100 * mfu[-1]:.1f})")
        twin.set_ylabel("MFU %")
    elif tflops:
        twin.plot(fsteps, tflops, color="tab:red", lw=1.2, ls="--", label=f"TFLOP/s per device (last {_last(tflops)})")
        twin.set_ylabel("TFLOP/s per device")
    twin.set_ylim(bottom=0)
    lines = ax.get_lines() + twin.get_lines()
    ax.legend(lines, [ln.get_label() for ln in lines], loc="best", framealpha=0.85)


def recipe_panel(ax, records: list[dict], panel: Panel) -> None:
    """A recipe's panel (panels()): its keys, each val_<key> dashed in <key>'s colour."""
    colors: dict[str, str] = {}
    for key in panel.keys:
        steps, values = series(records, key)
        val = key.startswith("val_")
        ax.plot(steps, values, lw=1.4, ls="--" if val else "-", marker="o" if val else None, ms=3,
                color=colors.setdefault(key.removeprefix("val_"), f"C{len(colors)}"),
                label=f"{key} (last {_last(values)})")
    ax.legend(loc="best", fontsize=8, framealpha=0.85)
    ax.set_title(panel.title)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmtrain.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output_dir", type=Path, help="a run's output_dir (holding metrics.jsonl), or the file itself")
    p.add_argument("--out", type=Path, help="PNG to write (default: OUTPUT_DIR/curves.png)")
    args = p.parse_args(argv)
    path = args.output_dir if args.output_dir.is_file() else args.output_dir / METRICS_FILE
    if not path.is_file():
        print(f"error: no {METRICS_FILE} in {args.output_dir}", file=sys.stderr)
        return 2
    records = read_records(path)
    if not records:
        print(f"error: {path} holds no records yet", file=sys.stderr)
        return 2
    if importlib.util.find_spec("matplotlib") is None:
        print("error: python -m llmtrain.plot draws with matplotlib, the llmtrain[plot] extra: "
              "pip install -e '.[plot]'", file=sys.stderr)
        return 2
    out = args.out or path.parent / "curves.png"
    last = max(r["step"] for r in records)
    plot(records, out, f"{path.parent}  ·  step {last:g}")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
