"""Exports checked in plain transformers (tests/scripts/hf_logits.py, an interpreter without llmtrain): the
logits of a baseline run's export on a probe batch, and another run's export (or adapter on its base) giving
those logits. The baseline is a run of the recipe itself (the plainest: one process, no wrapper), so a
regression in the recipe moves it."""

from __future__ import annotations

import re
from pathlib import Path

from helpers import REPO
from helpers.procs import launch

HF_LOGITS = REPO / "tests" / "scripts" / "hf_logits.py"
TOL = 1e-5  # max |logit difference|


def check_files(hf: Path) -> None:
    names = {p.name for p in hf.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names, names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl"))], "pickled weights exported"


def save_baseline(output_dir: Path) -> Path:
    """output_dir/hf's logits on the probe batch, saved as output_dir/probe.safetensors (returned)."""
    check_files(output_dir / "hf")
    probe = output_dir / "probe.safetensors"
    res = launch([HF_LOGITS, "--save", output_dir / "hf", probe])
    assert res.returncode == 0, res.stderr[-5000:]
    return probe


def assert_export_matches(output_dir: Path, baseline: Path, lora_base: Path | None = None) -> None:
    """output_dir/hf gives the baseline's logits; lora_base: so does output_dir/adapter on that base through
    PeftModel.from_pretrained (one launch)."""
    check_files(output_dir / "hf")
    adapter = [output_dir / "adapter", lora_base] if lora_base else []
    check = launch([HF_LOGITS, output_dir / "hf", baseline, *adapter])
    assert check.returncode == 0, check.stderr[-5000:]
    for key in ("maxdiff", "adapter_maxdiff") if lora_base else ("maxdiff",):
        diff = float(re.search(rf"\b{key}=(\S+)", check.stdout).group(1))
        assert diff < TOL, f"exported logits differ by {diff} ({key})"
