"""What the tests' generated worker scripts share (tests/helpers/procs.py's run_strategies starts them)."""

from __future__ import annotations

import sys

import torch.distributed as dist


def each_strategy(run) -> None:
    """A worker's main, as `python worker.py STRATEGIES OUT TESTS` on gloo ranks: run(strategy, out, rank) for each
    of the comma-separated STRATEGIES, in one process group (one launch: its start-up is most of its cost)."""
    strategies, out = sys.argv[1].split(","), sys.argv[2]
    dist.init_process_group("gloo")
    for strategy in strategies:
        run(strategy, out, dist.get_rank())
    dist.destroy_process_group()
