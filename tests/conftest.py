"""Fixtures shared by the test modules, and the hook that lets only slow tests launch processes; the helpers
themselves are in tests/helpers."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import EXPORT_LOGITS, procs
from helpers.procs import TWO_RANKS, losses, run_recipe


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the test's fixtures: session fixtures that launch runs are set up by the first test using them."""
    procs.running_slow_test = item.get_closest_marker("slow") is not None


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Path:
    """The plainest run (one process, no wrapper, micro 4, accum 1), through EXPORT_LOGITS so its
    export can be checked too: the losses every other configuration must match."""
    out = tmp_path_factory.mktemp("reference")
    run_recipe(out, "parallel.strategy=none", script=EXPORT_LOGITS)
    return out


@pytest.fixture(scope="session")
def reference(reference_run) -> list[float]:
    ref = losses(reference_run)
    assert len(ref) == 4 and ref[-1] < ref[0], ref
    return ref




@pytest.fixture(scope="session")
def two_rank_losses(tmp_path_factory) -> list[float]:
    """One node, 2 processes (torchrun --standalone), DDP: what the multi-node launches (Slurm, torchrun
    --nnodes 2, accelerate) of the same run must reproduce."""
    out = tmp_path_factory.mktemp("two_ranks")
    run_recipe(out, *TWO_RANKS, nproc=2)
    return losses(out)


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
