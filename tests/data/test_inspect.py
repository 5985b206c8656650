"""`python -m llmtrain.data` for every recipe: it takes any recipe's config (found by
its own sections) and shows every rows kind's parts from the data registry (Rows.parts), with their trained spans,
and a prompt's columns; every demo config is inspected; in process (no launch)."""

from __future__ import annotations

import json

from helpers import REPO, TINY
from llmtrain.data import IGNORE
from llmtrain.data.__main__ import config_class, main
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


# Every demo config, as its recipe reads it: (rows kind, the summary's last line). The SFT demo's export
# (model.path outputs/demo/hf, which the other demos start from) carries the bundled tokenizer.
DEMO_DATA = {
    "demo.yaml": ("tokens", "--- 3000 examples -> 1135 rows of 256 tokens; 286055 trained tokens; "
                            "packing efficiency 99.9%; 0 truncated; 0 skipped"),
    "demo-lora.yaml": ("tokens", "--- 600 examples -> 297 rows of 256 tokens; 10533 trained tokens; "
                                 "packing efficiency 76.7%; 0 truncated; 0 skipped"),
    "demo-distill.yaml": ("tokens", "--- 3000 examples -> 1135 rows of 256 tokens; 286055 trained tokens; "
                                    "packing efficiency 99.9%; 0 truncated; 0 skipped"),
    "demo-dpo.yaml": ("pairs", "--- 1000 examples -> 1000 pairs; 20825 trained tokens; 0 truncated; 0 skipped"),
    "demo-reward.yaml": ("pairs", "--- 2700 examples -> 2700 pairs; 55752 trained tokens; 0 truncated; 0 skipped"),
    "demo-grpo.yaml": ("prompts", "--- 128 examples -> 128 prompts; 0 trained tokens; 0 truncated; 0 skipped"),
    "demo-kto.yaml": ("unpaired", "--- 2000 examples -> 2000 rows; 20825 trained tokens; 0 truncated; 0 skipped"),
    "demo-agent-sft.yaml": ("tokens", "--- 400 examples -> 200 rows of 192 tokens; 14000 trained tokens; "
                                      "packing efficiency 93.7%; 0 truncated; 0 skipped"),
    "demo-agent.yaml": ("prompts", "--- 400 examples -> 400 prompts; 0 trained tokens; 0 truncated; 0 skipped"),
    "demo-vlm.yaml": ("tokens", "--- 400 examples -> 400 rows; 1553 trained tokens; 0 truncated; 0 skipped"),
}


def test_every_demo_config_is_inspected(capsys):
    assert set(DEMO_DATA) == {p.name for p in (REPO / "configs").glob("demo*.yaml")}, "a new demo config: add it"
    for name, (kind, last) in DEMO_DATA.items():
        config = REPO / "configs" / name
        rc, out, err = inspect(capsys, "--config", config, "--n", "1", TOKENIZER)
        assert rc == 0, f"{name}: {err}"
        assert out.splitlines()[-1] == last, name
        rc, out, err = inspect(capsys, "--config", config, "--json", "--n", "2", TOKENIZER)
        assert rc == 0, f"{name}: {err}"
        summary = json.loads(out)
        assert summary["rows_kind"] == kind and len(summary["samples"]) == 2, name


def test_a_prompt_is_shown_untrained_with_the_columns_its_rewards_read(capsys):
    rc, out, err = inspect(capsys, "--config", REPO / "configs" / "demo-grpo.yaml", "--json", "--n", "1", TOKENIZER)
    assert rc == 0, err
    (sample,) = json.loads(out)["samples"]
    (prompt,) = sample["parts"]
    assert prompt["name"] == "prompt" and set(prompt["labels"]) == {IGNORE} and len(prompt["input_ids"]) == 14
    assert prompt["text"] == "Anna had one hat. Lena gave her five hats. Now Anna has"
    assert sample["columns"] == {"answer": "six", "format": "(?s)\\s*\\w+ hats\\b.*"}
    rc, out, _ = inspect(capsys, "--config", REPO / "configs" / "demo-grpo.yaml", "--n", "1", TOKENIZER)
    assert out.splitlines()[:3] == ["--- row 0 prompt: 14 tokens, 0 trained",
                                    "Anna had one hat. Lena gave her five hats. Now Anna has",
                                    '--- row 0 columns: {"answer": "six", "format": "(?s)\\\\s*\\\\w+ hats\\\\b.*"}']


def test_a_missing_model_path_is_one_line_naming_it(capsys, tmp_path):
    rc, out, err = inspect(capsys, "--config", REPO / "configs" / "demo-grpo.yaml",
                           f"model.path={tmp_path / 'hf'}")
    assert rc == 2 and out == ""
    assert err.splitlines() == [f"error: model.path: no such directory: {tmp_path / 'hf'} (the tokenizer is read "
                                "from it: run what writes it first (configs/demo.yaml writes outputs/demo/hf), "
                                "or set tokenizer.path)"]
