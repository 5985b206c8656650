"""The consolidated export loads in plain transformers (no llmtrain import) and gives the trained model's
logits (tests/scripts/hf_logits.py, in a clean interpreter)."""

from __future__ import annotations

import re
from pathlib import Path

from helpers import REPO
from helpers.procs import launch

HF_LOGITS = REPO / "tests" / "scripts" / "hf_logits.py"


def assert_export_matches(output_dir: Path, lora_base: Path | None = None) -> None:
    """lora_base: also output_dir/adapter on that base through PeftModel.from_pretrained (one launch)."""
    hf = output_dir / "hf"
    names = {p.name for p in hf.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names, names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl"))], "pickled weights exported"
    adapter = [output_dir / "adapter", lora_base] if lora_base else []
    check = launch([HF_LOGITS, hf, output_dir / "probe.safetensors", *adapter], torchrun=False)
    assert check.returncode == 0, check.stderr[-5000:]
    for key in ("maxdiff", "adapter_maxdiff") if lora_base else ("maxdiff",):
        diff = float(re.search(rf"\b{key}=(\S+)", check.stdout).group(1))
        assert diff < 1e-5, f"exported logits differ by {diff} ({key})"
