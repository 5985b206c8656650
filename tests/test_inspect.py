"""`python -m llmtrain.data` for every recipe (issue 25 §4): it takes any recipe's config (its own sections, found
by them or named by --recipe) and shows every rows kind's parts from the data registry (Rows.parts), with their
trained spans; in process (no launch)."""

from __future__ import annotations

import json

from helpers import REPO, TINY
from llmtrain.data import IGNORE
from llmtrain.data.__main__ import _parts, config_class, main
from llmtrain.data.formats import RowPart, Rows
from llmtrain.recipes.dpo import DPOConfig

DPO_YAML = REPO / "configs" / "demo-dpo.yaml"
TOKENIZER = f"tokenizer.path={REPO / 'assets' / 'tokenizer'}"


def inspect(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(map(str, argv)))
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_dpo_config_shows_prompt_chosen_and_rejected_with_their_trained_spans(capsys):
    rc, out, err = inspect(capsys, "--config", DPO_YAML, "--json", "--n", "2", TOKENIZER)
    assert rc == 0, err
    summary = json.loads(out)
    assert summary["rows_kind"] == "pairs" and summary["packing_efficiency"] is None
    assert summary["num_examples"] == summary["num_rows"] == 1000
    for sample in summary["samples"]:
        prompt, chosen, rejected = sample["parts"]
        assert [prompt["name"], chosen["name"], rejected["name"]] == ["prompt", "chosen", "rejected"]
        assert set(prompt["labels"]) == {IGNORE} and "[[" not in prompt["text"]
        assert chosen["labels"] == chosen["input_ids"] and rejected["labels"] == rejected["input_ids"]
        assert chosen["text"].startswith("[[") and sample["text"].startswith("prompt: ")
    rc, out, _ = inspect(capsys, "--config", DPO_YAML, "--n", "1", TOKENIZER)
    assert rc == 0
    assert "--- row 0 prompt: " in out and "--- row 0 chosen: " in out and "--- row 0 rejected: " in out
    assert "--- 1000 examples -> 1000 pairs; " in out


def test_token_rows_show_their_trained_spans(capsys):
    rc, out, err = inspect(capsys, "--config", TINY, "--json", "--n", "1", "data.path=data/demo/instruct.jsonl",
                           "data.format=instruction", "data.seq_len=128")
    assert rc == 0, err
    summary = json.loads(out)
    assert summary["rows_kind"] == "tokens" and 0.5 < summary["packing_efficiency"] <= 1
    (part,) = summary["samples"][0]["parts"]
    assert part["name"] == "" and "[[" in part["text"] and summary["samples"][0]["text"] == part["text"]
    assert 0 < summary["trained_tokens"] < summary["num_tokens"]


def test_a_finetune_config_with_preference_data_shows_pairs(capsys):
    rc, out, err = inspect(capsys, "--config", TINY, "--json", "--n", "1", "data.path=data/demo/preference.jsonl",
                           "data.format=preference")
    assert rc == 0, err
    assert json.loads(out)["rows_kind"] == "pairs"


def test_the_recipe_is_found_by_its_sections_or_named(tmp_path, capsys):
    assert config_class(str(DPO_YAML), []) is DPOConfig
    assert config_class(str(TINY), ["dpo.beta=0.2"]) is DPOConfig
    assert config_class(str(TINY), ["grpo.beta=0.1"]).__name__ == "GRPOConfig"
    assert config_class(str(TINY), []).__name__ == "Config"
    odd = tmp_path / "odd.yaml"
    odd.write_text(TINY.read_text() + "nosuchrecipe:\n  x: 1\n")
    rc, _, err = inspect(capsys, "--config", odd)
    assert rc == 2 and "the section(s) nosuchrecipe" in err and "dpo, grpo" in err


def test_a_rows_kind_without_parts_is_shown_by_its_token_columns():
    prompts = Rows("prompts", lambda *a: {}, {"prompt_ids": [], "truncated": False}, packs=False)
    assert _parts(prompts, {"prompt_ids": [5, 6, 7], "truncated": False}) == \
        [RowPart("prompt_ids", [5, 6, 7], [IGNORE] * 3)]
