"""Stand-in for recipes/finetune.py in the Slurm template tests (launched by torchrun via LLMTRAIN_RECIPE):
it reports what the templates hand the recipe (environment, config path, overrides) without the cost of
a training run. tests/run/test_slurm_cluster.py runs the real recipe too (training, preemption and requeue).

    echo_rank.py --config PATH [key=value ...]

Every rank prints its RANK/WORLD_SIZE/LOCAL_RANK/node, does a gloo all_reduce of rank+1 and checks
the sum, and writes ``<standin.out>/run<restart>-rank<rank>.json``. Override read here:

    standin.out=DIR         where the JSON reports go (required)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    ov = dict(o.split("=", 1) for o in a.overrides)
    out = Path(ov["standin.out"])
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    print(f"RANK={rank} WORLD_SIZE={world} LOCAL_RANK={os.environ['LOCAL_RANK']} NODE={node} "
          f"RESTART={restart} CONFIG={a.config} OVERRIDES={a.overrides}", flush=True)

    dist.init_process_group("gloo")
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    assert t.item() == expected, (t.item(), expected)
    report = {
        "rank": rank, "world_size": world, "local_rank": int(os.environ["LOCAL_RANK"]), "node": node,
        "restart": restart, "allreduce_sum": t.item(), "config": a.config, "overrides": a.overrides,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "pid": os.getpid(),
    }
    (out / f"run{restart}-rank{rank}.json").write_text(json.dumps(report))
    print(f"rank {rank}: all_reduce sum {t.item()} (expected {expected})", flush=True)

    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
