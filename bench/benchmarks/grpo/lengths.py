"""GRPO benchmarks on the llama-32k shape (bench/configs/llama-32k.yaml's model, random weights) and the demo
prompts (data/demo/prompts.jsonl), G = 4, 16 completions a step, at each of --lengths (max_completion_length):

  generation  recipes/grpo.py's sampling under FSDP2 on 2 ranks (every unit gathered once per generation)
              vs the same model unwrapped in one process (strategy none, as many threads as the two ranks
              together) sampling the same batch: generated tokens/s (goal >= 0.8x)
  training    completion tokens trained per second and peak memory per rank of the same runs

    python bench/benchmarks/grpo/lengths.py [--steps 4] [--lengths 32 128] [--out DIR]

Prints a markdown table. FSDP2 gathers the weights once per generation, a cost fixed per step that longer
completions amortize: hence several lengths. TRL 1.16's GRPOTrainer comparison is bench/run.py's `grpo`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]


def config(tmp: Path, steps: int, length: int) -> Path:
    shape = yaml.safe_load((REPO / "bench" / "configs" / "llama-32k.yaml").read_text())
    cfg = {"model": shape["model"], "tokenizer": shape["tokenizer"],
           "data": {"path": "data/demo/prompts.jsonl", "format": "prompt", "seq_len": 64},
           "train": {"max_steps": steps, "micro_batch_size": 8, "grad_accum_steps": 1, "lr": 1.0e-5,
                     "warmup_steps": 0, "seed": 42},
           "grpo": {"num_generations": 4, "max_completion_length": length,
                    "reward_funcs": ["llmtrain.rewards:format_regex"]},
           "checkpoint": {"export_dtype": "fp32"}, "log": {"every_steps": 1, "progress": False}}
    path = tmp / f"grpo-32k-{length}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(name: str, cfg: Path, out: Path, nproc: int, threads: int, *overrides: str) -> list[dict]:
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
           if nproc > 1 else [sys.executable])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    subprocess.run([*cmd, "recipes/grpo.py", "--config", str(cfg), f"output_dir={out / name}", *overrides],
                   cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    return [r for r in map(json.loads, (out / name / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def steady(records: list[dict], key: str) -> float:
    later = [r[key] for r in records[1:]] or [records[0][key]]  # step 1 pays the warm-up
    return sum(later) / len(later)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 128], help="max_completion_length values")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    out.mkdir(parents=True, exist_ok=True)
    rows, ratios = [], []
    for length in args.lengths:
        cfg = config(out, args.steps, length)
        runs = {"fsdp2, 2 ranks x 1 thread": run(f"fsdp2-{length}", cfg, out, 2, 1, "parallel.strategy=fsdp2"),
                "unwrapped, 1 process x 2 threads": run(f"none-{length}", cfg, out, 1, 2, "parallel.strategy=none",
                                                        "train.micro_batch_size=16")}
        for name, recs in runs.items():
            trained = steady(recs, "trained_tokens") / steady(recs, "step_time_s")
            rows.append(f"| {length} | {name} | {steady(recs, 'generated_tokens_per_s'):.0f} | "
                        f"{steady(recs, 'generation_s'):.2f} | {trained:.0f} | {max(r['mem_gb'] for r in recs):.2f} |")
        a, b = (steady(r, "generated_tokens_per_s") for r in runs.values())
        ratios.append(f"max_completion_length {length}: generation, fsdp2 vs unwrapped {a / b:.2f}x")
    print(f"llama-32k shape, 16 completions/step (4 prompts x G 4), {args.steps} steps (means over steps 2..), "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| max_completion_length | run | generated tokens/s | generation s/step | completion tokens trained/s | "
          "peak mem/rank GB |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    print("\n" + "\n".join(ratios) + " (goal >= 0.8x)")


if __name__ == "__main__":
    main()
