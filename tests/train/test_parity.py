"""Same seed and global batch => the same loss curve, whatever the strategy, world size and
micro-batch / accumulation split (fp32, CPU, real gloo processes)."""

from __future__ import annotations

import pytest

from helpers.export import assert_export_matches
from helpers.procs import losses, run_recipe
from helpers.runs import Run

# (ranks, micro_batch_size, grad_accum_steps): global batch 4 rows in each.
SPLITS = [(1, 4, 1), (1, 2, 2), (2, 2, 1), (2, 1, 2)]
TOL = 2e-5


@pytest.mark.slow
def test_none_accumulation_matches_micro_batch(tmp_path, reference):
    run_recipe(tmp_path, "parallel.strategy=none", "train.micro_batch_size=2", "train.grad_accum_steps=2")
    assert losses(tmp_path) == pytest.approx(reference, abs=TOL)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp2"])
def test_strategy_and_split_give_same_losses(shared_runs, reference_run, reference, strategy):
    """(The runs are shared: ddp's 2x2x1 is the two-rank run, fsdp2's the one test_features loads from.)"""
    runs = {(ranks, micro, accum): Run((f"parallel.strategy={strategy}", f"train.micro_batch_size={micro}",
                                        f"train.grad_accum_steps={accum}"), nproc=ranks)
            for ranks, micro, accum in SPLITS}
    outs = shared_runs.get(runs, at_once=len(runs))
    for (ranks, micro, accum), out in outs.items():
        assert losses(out) == pytest.approx(reference, abs=TOL), f"{strategy} {ranks} ranks micro {micro} accum {accum}"
    # the 2-rank model's export gives the reference export's logits in transformers
    assert_export_matches(outs[2, 2, 1], reference_run / "probe.safetensors")
