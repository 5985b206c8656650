"""Stand-in for recipes/finetune.py in the Slurm template tests (launched by torchrun via LLMTRAIN_RECIPE).

    echo_rank.py --config PATH [key=value ...]

Every rank prints its RANK/WORLD_SIZE/LOCAL_RANK/node, does a gloo all_reduce of rank+1 and checks
the sum, and writes ``<standin.out>/run<restart>-rank<rank>.json``. Overrides read here:

    standin.out=DIR         where the JSON reports go (required)
    standin.mode=allreduce  (default) report and exit 0
    standin.mode=preempt    first run (SLURM_RESTART_COUNT unset/0): after the all_reduce write
                            ``ready``, wait for SIGUSR1, "checkpoint" (barrier), write
                            ``preempted-rank<r>.json`` and exit with LLMTRAIN_PREEMPT_EXIT_CODE, as
                            the real recipe will; later runs (requeued) report and exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
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
    mode = ov.get("standin.mode", "allreduce")
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    preempt_code = int(os.environ.get("LLMTRAIN_PREEMPT_EXIT_CODE", "42"))

    got_usr1 = []
    signal.signal(signal.SIGUSR1, lambda *_: got_usr1.append(time.time()))

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

    if mode == "preempt" and restart == 0:
        dist.barrier()
        if rank == 0:
            (out / "ready").write_text("ready\n")
        deadline = time.time() + 90
        while not got_usr1 and time.time() < deadline:
            time.sleep(0.05)
        if not got_usr1:
            print(f"rank {rank}: no SIGUSR1 within 90 s", flush=True)
            return 3
        print(f"rank {rank}: SIGUSR1 -> checkpoint and exit {preempt_code}", flush=True)
        dist.barrier()  # the real recipe's collective checkpoint save
        (out / f"preempted-rank{rank}.json").write_text(json.dumps({"rank": rank, "exit_code": preempt_code}))
        dist.destroy_process_group()
        return preempt_code

    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
