"""The VLM demo's curve in docs/vision.md is the committed measured run's (docs/measured/demo-vlm.jsonl, the
metrics.jsonl of configs/demo-vlm.yaml on 2 ranks), and that run reached what the demo promises."""

from __future__ import annotations

import json

import yaml

from helpers import REPO


def test_the_docs_curve_is_the_measured_runs():
    records = [json.loads(line) for line in (REPO / "docs" / "measured" / "demo-vlm.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["val_answer_accuracy"]) for r in records if "val_answer_accuracy" in r]
    config = yaml.safe_load((REPO / "configs" / "demo-vlm.yaml").read_text())
    assert [s for s, _ in evals] == list(range(25, config["train"]["max_steps"] + 1, config["eval"]["every_steps"]))
    assert evals[0][1] < 0.375 + 0.05 and evals[-1][1] >= 0.9  # from chance to >= 0.9
    line = "step " + ", ".join(f"{step}: {accuracy:.2f}" for step, accuracy in evals)
    assert line in (REPO / "docs" / "vision.md").read_text()
