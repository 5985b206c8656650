"""Fixtures shared by the test modules, and the hook that lets only slow tests launch processes; the helpers
themselves are in tests/helpers."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from helpers import procs, runs
from helpers.export import save_baseline
from helpers.procs import losses

# One intra-op thread in the test processes, as in every process they launch (OMP_NUM_THREADS=1): the models are
# tiny, and make test's 3 workers on 2 cores, each with 2 threads, spend their time on OpenMP barriers (a tiny
# model's generate, measured at load 20: 0.2 s of CPU and 2 s wall on one thread, 6 s and 66 s on two).
torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    """The modules with the most process-starting (slow) tests first: make test's workers take whole modules
    in this order as they free up (--no-loadscope-reorder keeps it), so the longest start first and the short
    ones fill the gaps at the end rather than one long module running alone there."""
    module = [item.nodeid.split("::")[0] for item in items]
    slow = Counter(m for m, item in zip(module, items) if item.get_closest_marker("slow"))
    order = sorted(range(len(items)), key=lambda i: -slow[module[i]])  # stable: a module's tests stay together
    items[:] = [items[i] for i in order]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Runs before the test's fixtures are set up: a session fixture that launches runs is set up by the first
    test using it, which must then be marked slow too."""
    procs.running_slow_test = item.get_closest_marker("slow") is not None


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory) -> runs.SharedRuns:
    """End-to-end runs each started once per session, read by every test that asks for them (helpers/runs.py)."""
    return runs.SharedRuns(tmp_path_factory)


@pytest.fixture(scope="session")
def reference_run(shared_runs) -> Path:
    """The plainest run of the recipe (one process, no wrapper, micro 4, accum 1): the losses every other
    configuration must match, and its export's logits (probe.safetensors) those of every other export. Its
    last step is checkpointed too (checkpoints/step_4), for the export to be compared with."""
    out = shared_runs(runs.REFERENCE)
    save_baseline(out)
    return out


@pytest.fixture(scope="session")
def reference(reference_run) -> list[float]:
    ref = losses(reference_run)
    assert len(ref) == 4 and ref[-1] < ref[0], ref
    return ref


@pytest.fixture(scope="session")
def two_rank_run(shared_runs) -> Path:
    """One node, 2 processes (torchrun --standalone), DDP, the reference run's global batch."""
    return shared_runs(runs.TWO_RANK)


@pytest.fixture(scope="session")
def two_rank_losses(two_rank_run) -> list[float]:
    """What the multi-node launches (Slurm, torchrun --nnodes 2, accelerate) of the two-rank run must reproduce."""
    return losses(two_rank_run)


class _Exit(Exception):
    def __init__(self, code: int):
        self.code = code


def _no_process_group(*args, **kwargs):
    raise AssertionError("set-up passed: the recipe went on to its process group")


@pytest.fixture
def run_setup(monkeypatch, capfd):
    """run_setup(script, *args, world_size=1) -> (exit code, stdout, stderr): the script run in this process
    as `python script args` runs it (sys.argv, its __main__ block, exit code through distributed.hard_exit),
    as rank 0 of `world_size` would (WORLD_SIZE), for set-up errors: it must stop before its process group. A
    real launch costs seconds of start-up per case; tests/config/test_config.py keeps one real 2-rank launch."""
    import runpy
    import sys

    from llmtrain import distributed

    def hard_exit(code: int):
        raise _Exit(code)

    def run(script: Path, *args, world_size: int = 1) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", [str(script), *map(str, args)])
        monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the repository first
        monkeypatch.setattr(distributed, "hard_exit", hard_exit)
        monkeypatch.setattr(distributed, "init", _no_process_group)
        for name, value in (("WORLD_SIZE", world_size), ("RANK", 0), ("LOCAL_RANK", 0)):
            monkeypatch.setenv(name, str(value))
        capfd.readouterr()
        with pytest.raises(_Exit) as exited:
            runpy.run_path(str(script), run_name="__main__")
        out, err = capfd.readouterr()  # fd-level: errors are written with os.write (distributed.write_line)
        return exited.value.code, out, err

    return run


@pytest.fixture
def single_process_group():
    """A real 1-rank gloo group, in this process (for library calls that run collectives)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def base(reference_run) -> Path:
    """The reference run's export: a tiny Llama in Hugging Face format (model.safetensors, tied embeddings)."""
    return reference_run / "hf"
