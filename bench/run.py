#!/usr/bin/env python
"""llmtrain benchmarks: figures measured side by side in one run and reported as ratios (absolute
CPU times on a shared machine are not stable; ratios of interleaved runs are).

    python bench/run.py [--quick] [--only NAME ...] [--results-dir bench/results]

Prints one markdown table per benchmark, then a summary of the ratios against their targets, and
writes <results-dir>/<YYYY-MM-DD>.json (<date>-quick.json with --quick) and a PNG of the ratios next
to it. A later run on the same day with --only replaces only the benchmarks it ran in that file.
The 1-minute load average before and after each benchmark is recorded (the machine may be shared).

  Shapes (bench/configs/): llama-32k.yaml, a Llama 2 / Mistral proportion scaled down (vocab 32,000, hidden
  256, 4 layers, 8 heads / 4 KV, untied, seq 256, micro-batch 4), and llama-128k.yaml (Llama 3's vocabulary
  128,256, hidden 256, 2 layers, seq 2048, micro-batch 1). The demo model is used by `data` only.

The benchmarks, in the order they run (each bench/benchmarks/<name>.py, or a folder bench/benchmarks/<name>/ with
the workers it launches, whose docstring says what it measures and against which target; what they are compared
with is in bench/baselines/):
  overhead       the recipe vs the bare tutorial loop (bench/baselines/bare_loop.py), tokens/s
  loss           train.loss_impl=chunked vs full: step time and peak memory per rank
  trainer        useful tokens/s vs transformers.Trainer (chat SFT)
  trl            useful tokens/s vs TRL's SFTTrainer (its own venv, --trl-venv)
  dpo            recipes/dpo.py vs TRL's DPOTrainer
  grpo           recipes/grpo.py vs TRL's GRPOTrainer
  dpo_reference  DPO's precomputed reference vs the live one, peak memory
  distill        recipes/distill.py vs full-logits KD (TRL's loss) at 131k ids: peak memory, step time; offline teacher
  memory         training state and loading memory per rank, ddp / fsdp / fsdp2
  data           llmtrain.data.build's tokens/s vs what the demo consumes
  checkpoint     DCP save / load and the HF export vs `dd`
  vlm            image chat SFT of a tiny Qwen2.5-VL (vocabulary 151,936) vs TRL's SFTTrainer
  agent          tool-use GRPO in the agent demo's environment vs TRL's GRPOTrainer(environment_factory)

--quick makes every benchmark tiny (a smoke run: the figures mean little). The GPU benchmark is a
separate script, bench/gpu.sh (see its header).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, BenchError

from benchmarks.base import BENCH, Ctx, table

NAMES = ["overhead", "loss", "trainer", "trl", "dpo", "grpo", "dpo_reference", "distill", "memory", "data",
         "checkpoint", "reward", "kto", "vlm", "agent"]


# -- report ----------------------------------------------------------------------------------------

def machine() -> dict:
    info = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        mem = Path("/proc/meminfo").read_text().split()
        info["mem_gib"] = round(int(mem[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        import importlib.metadata as md

        info.update({k: md.version(k) for k in ("torch", "transformers", "accelerate", "datasets")})
    except Exception:
        pass
    return info


def fmt_ratio(r: dict) -> str:
    return "n/a" if r["value"] is None else f"{r['value']:.3g}x"


def summary(results: dict) -> str:
    rows = []
    for name, res in results.items():
        if "error" in res:
            rows.append([name, "failed", "", "", res["error"].splitlines()[0][:100]])
            continue
        for r in res["ratios"]:
            target = "" if r["target"] is None else f"{r['op']} {r['target']}x"
            met = {True: "met", False: "**not met**", None: "(no target)"}[r["met"]]
            rows.append([r["name"], fmt_ratio(r), target, met, r.get("note", "")])
    return table(["ratio", "measured", "target", "", "note"], rows)


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = [r for res in results.values() if "ratios" in res for r in res["ratios"] if r["value"]]
    if not items:
        return
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(items) + 1.6))
    ys = list(range(len(items)))[::-1]
    colors = {True: "#2e7d32", False: "#c62828", None: "#78909c"}
    ax.barh(ys, [r["value"] for r in items], color=[colors[r["met"]] for r in items], height=0.6)
    for y, r in zip(ys, items):
        ax.text(max(r["value"], r["target"] or 0) * 1.06, y, fmt_ratio(r), va="center", fontsize=8)
        if r["target"] is not None:
            ax.plot([r["target"]] * 2, [y - 0.4, y + 0.4], color="black", linewidth=2)
    ax.axvline(1.0, color="#999", linewidth=0.8, linestyle=":")
    ax.set_yticks(ys, [r["name"] for r in items], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(right=max(max(r["value"], r["target"] or 0) for r in items) * 3)
    ax.set_xlabel("ratio (log scale); black tick = target; green met, red not met, grey no target")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(
                                    __doc__.splitlines()[5:]))
    p.add_argument("--quick", action="store_true", help="tiny versions of every benchmark (a smoke run)")
    p.add_argument("--only", nargs="+", choices=NAMES, metavar="NAME", help=f"run only these: {', '.join(NAMES)}")
    p.add_argument("--results-dir", type=Path, default=BENCH / "results")
    p.add_argument("--pairs", type=int, default=2,
                   help="A B / B A pairs of the overhead, loss, trainer and trl benchmarks (1 on a busy machine)")
    p.add_argument("--trl-venv", type=Path, default=REPO / ".venv-trl",
                   help="virtual environment for TRL (the trl benchmark); created when missing")
    p.add_argument("--keep", action="store_true", help="keep the working directory (logs, runs) in outputs/")
    args = p.parse_args(argv)
    names = [n for n in NAMES if not args.only or n in args.only]
    (REPO / "outputs").mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-", dir=REPO / "outputs"))
    ctx = Ctx(args.quick, work, args.trl_venv, args.pairs)
    started = time.time()
    results: dict = {}
    load = [os.getloadavg()[0]]
    try:
        for name in names:
            t0 = time.perf_counter()
            print(f"\n## {name}{' (quick)' if args.quick else ''}\n", flush=True)
            try:
                res = importlib.import_module(f"benchmarks.{name}").bench(ctx)
            except Exception as e:  # one failed benchmark is reported; the others still run
                import traceback

                res = {"title": name, "error": f"{type(e).__name__}: {e}"}
                print(f"FAILED: {res['error'][-3000:]}", flush=True)
                if not isinstance(e, BenchError):
                    traceback.print_exc()
            res["seconds"] = round(time.perf_counter() - t0, 1)
            res["finished"] = dt.datetime.now().isoformat(timespec="seconds")
            load.append(os.getloadavg()[0])
            if "table" in res:
                print(f"### {res['title']}\n\n{res['table']}\n\n({res['seconds']:.0f} s)", flush=True)
            results[name] = res
    finally:
        if args.keep:
            print(f"\nworking directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    date = dt.date.today().isoformat()
    stem = f"{date}-quick" if args.quick else date
    args.results_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.results_dir / f"{stem}.json"
    doc = json.loads(json_path.read_text()) if json_path.is_file() else {"benchmarks": {}}
    doc["benchmarks"].update(results)
    doc.update({"date": date, "quick": args.quick, "machine": machine(),
                "command": "python bench/run.py" + (" --quick" if args.quick else "") +
                           (f" --only {' '.join(args.only)}" if args.only else ""),
                "last_run": {"benchmarks": names, "seconds": round(time.time() - started, 1),
                             "load_average_1min": [round(x, 2) for x in load]}})
    json_path.write_text(json.dumps(doc, indent=1))
    png = json_path.with_suffix(".png")
    if importlib.util.find_spec("matplotlib") is None:  # the picture is extra; the results are the JSON and tables
        print("\nno picture: drawing it needs matplotlib, the llmtrain[plot] extra (pip install -e '.[plot]')")
        png = None
    else:
        plot(doc["benchmarks"], png, f"llmtrain bench {stem}: {doc['machine'].get('cpus')} CPU cores "
                                     f"({doc['machine'].get('cpu', '?')}), ratios measured side by side")
    print(f"\n## Summary ({time.time() - started:.0f} s; 1-min load average {' -> '.join(f'{x:.1f}' for x in load)})\n")
    print(summary(results))
    print(f"\nwrote {json_path.relative_to(REPO) if json_path.is_relative_to(REPO) else json_path}"
          + (f" and {png.name}" if png else ""))
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
