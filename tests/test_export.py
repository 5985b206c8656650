"""The consolidated export of the plainest run (the reference: one process, no wrapper) holds the trained
weights: tensor for tensor the offline conversion of its last checkpoint (the model as DCP saved it). The
reference fixture loads it in plain transformers (no llmtrain import): its logits there are the baseline that
the other runs' exports must reproduce (tests/helpers/export.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from helpers.procs import launch


@pytest.mark.slow
def test_export_of_single_process_run(tmp_path, reference_run):
    res = launch(["-m", "llmtrain.convert", reference_run / "checkpoints" / "step_4", tmp_path], torchrun=False,
                 timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    converted = load_file(tmp_path / "model.safetensors")
    exported = load_file(reference_run / "hf" / "model.safetensors")
    assert converted.keys() == exported.keys()
    for name, tensor in exported.items():
        assert torch.equal(converted[name], tensor), name
