"""What a distillation run prints: no FSDP2 "returned a view tensor" warning under fsdp2, whose losses are the
1-process run's."""

from __future__ import annotations

import pytest

from helpers.procs import losses, run_side_by_side


@pytest.mark.slow
def test_distill_under_fsdp2_prints_no_view_warning(tmp_path, base):
    """FSDP2 warned once per rank that the student's forward "returned a view tensor" (the KD loss, a view of
    the chunked sums): gone from a 2-rank fsdp2 run's output, whose losses are the 1-process run's."""
    from helpers.distill import DISTILL, distill_args

    runs = {"fsdp2": (tmp_path / "fsdp2", 2, distill_args(base, "parallel.strategy=fsdp2", "train.micro_batch_size=1",
                                                           "train.grad_accum_steps=2"), DISTILL),
            "none": (tmp_path / "none", 1, distill_args(base, "parallel.strategy=none"), DISTILL)}
    res = run_side_by_side(runs, at_once=2)
    for name, r in res.items():
        assert "view tensor" not in r.stdout + r.stderr, (name, r.stderr[-3000:])
    assert losses(tmp_path / "fsdp2") == pytest.approx(losses(tmp_path / "none"), abs=2e-5)
