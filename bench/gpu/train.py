"""recipes/finetune.py's training (llmtrain.train) with random token batches instead of the data pipeline,
for bench/gpu.sh.

    torchrun --standalone --nproc_per_node=1 bench/gpu/train.py --config bench/gpu/gpu-1b.yaml [key=value ...]
    python bench/gpu/train.py --table [--warmup 10] DIR [DIR ...]   # the table of finished runs

The recipe's library calls run unchanged (its command line and config, preflight, model build, parallelize,
train_step, the loop with tokens/s and MFU, checkpoints if asked) with two differences, so that it needs no
`datasets` (GPU machines may not have it) and spends its time on training:
  * fixed random token batches instead of llmtrain.data (micro_batch_size x seq_len, every position
    trained, position_ids 0..seq_len-1 as an unpacked row)
  * no final Hugging Face export
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


class RandomSteps:
    def __init__(self, vocab: int, seq_len: int, micro: int, accum: int, seed: int, samples_seen: int,
                 global_batch: int, n_distinct: int = 4):
        import torch

        g = torch.Generator().manual_seed(seed)
        self.batches = []
        for _ in range(n_distinct):
            ids = torch.randint(0, vocab, (micro, seq_len), generator=g)
            self.batches.append({"input_ids": ids, "labels": ids.clone(),
                                 "position_ids": torch.arange(seq_len).expand(micro, -1).contiguous()})
        self.accum, self.i = accum, 0
        self.samples_seen, self.global_batch = samples_seen, global_batch

    def __next__(self):
        out = [self.batches[(self.i + k) % len(self.batches)] for k in range(self.accum)]
        self.i += self.accum
        self.samples_seen += self.global_batch
        return out

    def position(self) -> dict:
        return {"samples_seen": self.samples_seen}


def random_data_recipe():
    """recipes/finetune.py's objective on random tokens (RandomSteps), without the export."""
    from llmtrain.recipes.base import Recipe
    from llmtrain.recipes.sft import TokenObjective
    from llmtrain.train.source import DataSource

    class RandomData(Recipe):
        name = "finetune"
        usage = __doc__
        final_export = False
        sequence_parallel = True  # bench/gpu.sh's long-context rows (parallel.sp_size)

        def source(self, run):
            cfg = run.cfg
            micro, accum = cfg.train.micro_batch_size, cfg.train.grad_accum_steps
            return None, DataSource(RandomSteps(len(run.tokenizer), cfg.data.seq_len, micro, accum,
                                                cfg.train.seed + run.env.dp_rank,  # a sequence group: alike
                                                run.state.data.get("samples_seen", 0), run.global_batch))

        def setup(self, run, built):
            super().setup(run, built)
            self.objective = TokenObjective(run.token_loss)
    return RandomData()


def table(dirs: list[str], warmup_steps: int = 10) -> str:
    """Markdown table of finished runs (output_dir/metrics.jsonl): the windows after warmup_steps."""
    rows = ["| run | tokens/s | tokens/s/device | TFLOP/s/device | MFU | step s | peak mem GiB (alloc / reserved) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for d in dirs:
        path = Path(d) / "metrics.jsonl"
        name = Path(d).name
        recs = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
        recs = [r for r in recs if "tokens_per_sec" in r]
        prev, steps, inverse, keep = 0, 0, 0.0, []
        for r in recs:  # windows of equal step counts: the aggregate rate is their harmonic mean
            if prev >= warmup_steps:
                inverse += (r["step"] - prev) / r["tokens_per_sec"]
                steps += r["step"] - prev
                keep.append(r)
            prev = r["step"]
        if not keep:
            rows.append(f"| {name} | failed or too short (see {d}.log) | | | | | |")
            continue
        tps, last = steps / inverse, keep[-1]
        devices = last["tokens_per_sec"] / last["tokens_per_sec_per_device"]
        # tflops and mfu are proportional to a window's rate: scale the last window's to the aggregate
        tflops = last["tflops"] * tps / last["tokens_per_sec"]
        mfu = None if last.get("mfu") is None else last["mfu"] * tps / last["tokens_per_sec"]
        step_s = sum(r["step_time_s"] for r in keep) / len(keep)
        reserved = last.get("mem_reserved_gb")
        rows.append(f"| {name} | {tps:,.0f} | {tps / devices:,.0f} | {tflops:.3g} | "
                    f"{'n/a' if mfu is None else f'{mfu:.1%}'} | {step_s:.3f} | "
                    f"{last['mem_gb']:.1f} / {'n/a' if reserved is None else f'{reserved:.1f}'} |")
    return "\n".join(rows)


def main() -> None:
    if sys.argv[1:2] == ["--table"]:
        import argparse

        p = argparse.ArgumentParser(prog="bench/gpu/train.py --table")
        p.add_argument("--warmup", type=int, default=10, help="steps left out of the rates")
        p.add_argument("dirs", nargs="+")
        args = p.parse_args(sys.argv[2:])
        print(table(args.dirs, args.warmup))
        return
    from llmtrain.distributed import hard_exit

    hard_exit(random_data_recipe().main(sys.argv[1:]))


if __name__ == "__main__":
    main()
