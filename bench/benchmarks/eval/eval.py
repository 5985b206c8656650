"""lm-evaluation-harness in llmtrain: scoring the bundled demo tasks (assets/eval/demo) with 1 vs 2 processes
(llmtrain.eval's data parallelism), and what eval.harness adds to a training run's wall time.

    python bench/benchmarks/eval/eval.py scoring --model outputs/demo/hf   # 1 vs 2 processes, scoring time only
    python bench/benchmarks/eval/eval.py overhead       # the demo config with and without eval.harness

scoring: each process loads the tasks and the model, then the scoring alone is timed between two barriers
(wall and this process's CPU seconds), so start-up (imports, task building) is left out. overhead: the SFT demo
(configs/demo.yaml, 2 processes) as `make demo` runs it, then again with eval.harness.tasks=[assets/eval/demo] at
its defaults (the final export scored once); the ratio of the wall times."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/: common, benchmarks

from common import REPO, torchrun

TASKS = REPO / "assets" / "eval" / "demo"


def probe(model: Path, out: Path) -> None:
    """One process of the scoring measurement (under torchrun)."""
    import torch.distributed as dist

    from llmtrain import eval as harness

    dist.init_process_group("gloo")
    tasks = harness.load_tasks([str(TASKS)])
    loaded = harness.load_model(model, None, "fp32", "cpu")
    dist.barrier()
    t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_utime
    results = harness.evaluate(loaded.model, loaded.tokenizer, tasks, data_parallel=dist.get_world_size() > 1)
    cpu = resource.getrusage(resource.RUSAGE_SELF).ru_utime - c0
    dist.barrier()
    wall = time.perf_counter() - t0
    cpus = [None] * dist.get_world_size()
    dist.all_gather_object(cpus, cpu)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"wall_s": wall, "cpu_s": cpus, "scores": harness.flat_scores(results)}))
    dist.destroy_process_group()


def scoring(model: Path) -> str:
    rows = ["| processes | scoring wall s | CPU s per process | speed-up | same scores |",
            "| ---: | ---: | ---: | ---: | --- |"]
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for n in (1, 2):
            out = Path(tmp) / f"{n}.json"
            torchrun([__file__, "_probe", "--model", model, "--out", out], nproc=n, timeout=900)
            r = json.loads(out.read_text())
            base = base or r
            rows.append(f"| {n} | {r['wall_s']:.2f} | {' / '.join(f'{c:.2f}' for c in r['cpu_s'])} | "
                        f"{base['wall_s'] / r['wall_s']:.2f}x | {r['scores'] == base['scores']} |")
    return "\n".join(rows)


def overhead() -> str:
    rows = ["| run | wall s | harness scores logged |", "| --- | ---: | --- |"]
    walls = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("demo", []), ("demo + eval.harness", [f"eval.harness.tasks=[{TASKS}]"])):
            out = Path(tmp) / name.replace(" ", "")
            _, walls[name] = torchrun([REPO / "recipes" / "finetune.py", "--config", REPO / "configs" / "demo.yaml",
                                       f"output_dir={out}", *extra], nproc=2, timeout=1800)
            logged = [k for line in (out / "metrics.jsonl").read_text().splitlines()
                      for k in json.loads(line) if k.startswith("harness/")]
            rows.append(f"| {name} | {walls[name]:.1f} | {', '.join(logged) or '-'} |")
    rows.append(f"\noverhead: {walls['demo + eval.harness'] / walls['demo'] - 1:+.1%} of the demo's wall time")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["scoring", "overhead", "_probe"])
    p.add_argument("--model", type=Path, default=REPO / "outputs" / "demo" / "hf")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.what == "_probe":
        from llmtrain.distributed import hard_exit

        probe(args.model, args.out)
        hard_exit(0)  # no interpreter teardown (torch._dynamo's can abort a gloo process at exit)
    else:
        print(scoring(args.model) if args.what == "scoring" else overhead())


if __name__ == "__main__":
    main()
