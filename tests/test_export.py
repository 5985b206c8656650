"""The consolidated export loads in plain transformers and gives the trained model's logits."""

from __future__ import annotations

import re

import pytest

from conftest import REPO, TINY, launch

SCRIPT = REPO / "tests" / "scripts"


@pytest.mark.slow
@pytest.mark.parametrize("strategy,nproc", [("none", 1), ("ddp", 2), ("fsdp", 2), ("fsdp2", 2)])
def test_export_reloads_with_same_logits(tmp_path, strategy, nproc):
    res = launch([SCRIPT / "export_logits.py", "--config", TINY, f"output_dir={tmp_path}",
                  f"parallel.strategy={strategy}", "train.max_steps=3"], nproc=nproc)
    assert res.returncode == 0, res.stderr[-5000:]
    hf = tmp_path / "hf"
    names = {p.name for p in hf.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names, names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl"))], "pickled weights exported"
    check = launch([SCRIPT / "hf_logits.py", hf, tmp_path / "probe.safetensors"], torchrun=False)
    assert check.returncode == 0, check.stderr[-5000:]
    diff = float(re.search(r"maxdiff=(\S+)", check.stdout).group(1))
    assert diff < 1e-5, f"{strategy}: exported logits differ by {diff}"
