"""Fixtures shared by the test modules, and the hook that lets only slow tests launch processes; the helpers
themselves are in tests/helpers."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import procs
from helpers.export import save_baseline
from helpers.procs import TWO_RANKS, losses, run_recipe


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Runs before the test's fixtures are set up: a session fixture that launches runs is set up by the first
    test using it, which must then be marked slow too."""
    procs.running_slow_test = item.get_closest_marker("slow") is not None


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Path:
    """The plainest run of the recipe (one process, no wrapper, micro 4, accum 1): the losses every other
    configuration must match, and its export's logits (probe.safetensors) those of every other export. Its
    last step is checkpointed too (checkpoints/step_4), for the export to be compared with."""
    out = tmp_path_factory.mktemp("reference")
    run_recipe(out, "parallel.strategy=none", "checkpoint.every_steps=4")
    save_baseline(out)
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
