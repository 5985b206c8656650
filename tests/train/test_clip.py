"""Gradient clipping, STRATEGIES[name].clip_grad_norm: the norm returned is the unsharded model's gradient norm
(on every rank), and clipping scales the gradients by max_norm / norm; below max_norm (or with max_norm 0)
nothing changes. One process for the unwrapped model; ddp, fsdp and fsdp2 (both of its paths) in one 2-rank
launch of tests/scripts/clip_norms.py."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from helpers import REPO
from helpers.procs import launch
from llmtrain.parallelize import STRATEGIES


def grads_of_a_small_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model[2].bias.requires_grad_(False)  # a parameter without a gradient is left out, not an error
    model(torch.randn(8, 8)).square().mean().backward()
    return model


def test_unwrapped_norm_and_clipping():
    model = grads_of_a_small_model()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    norm = torch.cat([g.flatten() for g in grads]).norm().item()
    clip = STRATEGIES["none"].clip_grad_norm
    assert clip(model, 0).item() == pytest.approx(norm, rel=1e-6)  # max_norm 0: measured, not clipped
    assert clip(model, 2 * norm).item() == pytest.approx(norm, rel=1e-6)  # below max_norm: unchanged
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert clip(model, norm / 4).item() == pytest.approx(norm, rel=1e-6)  # returns the norm before clipping
    assert clip(model, 0).item() == pytest.approx(norm / 4, rel=1e-5)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g / 4, rtol=1e-5, atol=0)  # one scale for all: the direction kept


@pytest.mark.slow
def test_every_strategy_measures_the_unsharded_norm_and_clips_to_max_norm(tmp_path):
    res = launch([REPO / "tests" / "scripts" / "clip_norms.py", tmp_path / "clip.json"], nproc=2, timeout=180)
    assert res.returncode == 0, res.stderr[-4000:]
    results = json.loads((tmp_path / "clip.json").read_text())
    ref = results.pop("reference")
    assert set(results) == {"ddp", "fsdp", "fsdp2", "fsdp2_mixed"}
    layouts = {"ddp": 0, "fsdp": 0, "fsdp2": 1, "fsdp2_mixed": 2}  # fsdp2: the local-shard path; mixed: DTensor's
    for kind, ranks in results.items():
        assert len(ranks) == 2 and ranks[0] == ranks[1], (kind, ranks)  # every rank agrees
        got = ranks[0]
        assert got["before"] == pytest.approx(ref, rel=1e-6), (kind, got)
        assert got["after"] == pytest.approx(ref / 2, rel=1e-5), (kind, got)
        assert got["dtensor_layouts"] == layouts[kind], (kind, got)
        if kind != "fsdp":  # the full gradients: the unsharded model's, times max_norm / norm
            assert got["grad_diff"] < 1e-7, (kind, got)
