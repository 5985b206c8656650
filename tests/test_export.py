"""The consolidated export loads in plain transformers (no llmtrain import) and gives the trained
model's logits. Runs made through tests/scripts/export_logits.py save those logits as a probe."""

from __future__ import annotations

import pytest

from helpers.export import assert_export_matches


@pytest.mark.slow
def test_export_of_single_process_run(reference_run):
    assert_export_matches(reference_run)
