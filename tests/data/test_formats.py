"""The data formats' registry (llmtrain.data.formats.FORMATS): every format builds rows from sample records
and collates them into the micro-batch its kind of rows trains on; which formats a data section reads and
the one kind of rows they make; config's choices are the registry's names."""

from __future__ import annotations

import json
import typing

import pytest
import torch
from torch.utils.data import default_collate
from transformers import AutoTokenizer

from helpers import REPO
from llmtrain.config import ConfigError, DataConfig, SourceConfig
from llmtrain.data import FORMATS, IGNORE, build, check, formats_used, rows_kind

COLOUR = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."}]
SUM = [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"}]
# Two records per format (a new format adds its own), and the tokens each collated row trains on.
SAMPLES = {
    "text": [{"text": "the red ball rolls under the old wooden table"}, {"text": "a blue cup"}],
    "instruction": [{"instruction": "Name a colour.", "output": "Red."},
                    {"instruction": "Add them.", "input": "2 and 3", "output": "5"}],
    "chat": [{"messages": COLOUR}, {"conversations": [{"from": "human", "value": "Add 2 and 3."},
                                                      {"from": "gpt", "value": "5"}]}],
    "preference": [{"prompt": "Name a colour.", "chosen": " Red.", "rejected": " Ball."},
                   {"chosen": SUM, "rejected": [SUM[0], {"role": "assistant", "content": "6"}]}],
    "unpaired": [{"prompt": "Name a colour.", "completion": " Red.", "label": True},
                 {"prompt": SUM[:1], "completion": SUM[1:], "label": False}],
    "prompt": [{"prompt": "Add 2 and 3.", "answer": "5"}, {"prompt": SUM[:1], "answer": "5"}],
}
TRAINED = {
    "text": [],  # filled below from the tokenizer: one packed row, each document but its first token
    "instruction": ["Red.<|end_of_text|>", "5<|end_of_text|>"],
    "chat": ["Red.<|eot_id|>", "5<|eot_id|>"],  # the template's end-of-turn token is trained too
    "preference": [" Red.<|end_of_text|>", "5<|eot_id|>", " Ball.<|end_of_text|>", "6<|eot_id|>"],  # chosen, rejected
    "unpaired": [" Red.<|end_of_text|>", "5<|eot_id|>"],  # each row's completion (the recipe adds its KL rows)
    "prompt": [],  # prompts train nothing: see test_prompts_keep_their_columns_for_the_rewards
}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(REPO / "assets" / "tokenizer")


@pytest.mark.parametrize("name", FORMATS)
def test_every_format_builds_rows_and_collates_them(tmp_path, tok, name):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in SAMPLES[name]))
    built = build(DataConfig(path=str(path), format=name, seq_len=128, packing=name == "text"), tok, seed=0)
    assert (built.stats.num_examples, built.stats.skipped, built.stats.truncated) == (2, 0, 0)
    rows = [built.train[i] for i in range(len(built.train))]
    if name == "prompt":  # rows that read like token rows, none of them trained; batches of prompts
        assert all((r["labels"] == IGNORE).all() for r in rows)
        return
    batch = built.collate(rows) if built.collate else default_collate(rows)
    ids, labels = batch["input_ids"], batch["labels"]
    assert torch.equal(labels[labels != IGNORE], ids[labels != IGNORE])
    trained = [tok.decode(ids[r][labels[r] != IGNORE]) for r in range(len(ids))]
    if name == "text":
        docs = [tok(r["text"])["input_ids"] + [tok.eos_token_id] for r in SAMPLES["text"]]
        assert ids.shape == (1, 128) and trained == [tok.decode(docs[0][1:] + docs[1][1:])]
    else:
        assert trained == TRAINED[name]
    kind = FORMATS[name].rows
    assert (kind.name, built.collate is None) == ((kind.name, False) if name in ("preference", "unpaired")
                                                  else ("tokens", True))
    if kind.index:  # the training rows' positions ride along in their batch
        assert batch[kind.index].tolist() == [0, 1]


@pytest.mark.parametrize("name, packing, truncated", [("text", True, 0), ("text", False, 1), ("instruction", True, 2),
                                                     ("chat", True, 2), ("preference", True, 1), ("unpaired", True, 1),
                                                     ("prompt", True, 1)])
def test_examples_longer_than_seq_len_are_counted(tmp_path, tok, name, packing, truncated):
    """Packing cuts a document across rows (not truncated); other examples and pairs are cut to seq_len."""
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in SAMPLES[name]))
    assert build(DataConfig(path=str(path), format=name, seq_len=12, packing=packing), tok, seed=0).stats.truncated \
        == truncated


def test_formats_used_and_the_kind_of_rows(tmp_path):
    text, chat, pairs = (SourceConfig(f"{f}.jsonl", f) for f in ("text", "chat", "preference"))
    assert formats_used(DataConfig(format="chat")) == {"chat"}
    mixed = DataConfig(format="preference", sources=[text, chat])  # data.sources replace data.format
    assert formats_used(mixed) == {"text", "chat"} and rows_kind(mixed).name == "tokens"
    assert rows_kind(DataConfig(sources=[pairs, pairs])).name == "pairs"
    with pytest.raises(ConfigError, match=r"different kinds of rows \(chat: tokens, preference: pairs\)"):
        rows_kind(DataConfig(sources=[chat, pairs]))
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(SAMPLES["preference"][0]) + "\n")
    with pytest.raises(ConfigError, match="data.streaming: data.format preference makes pairs, .* cannot be streamed"):
        check(DataConfig(path=str(path), format="preference", streaming=True))


def test_config_format_choices_are_the_registry():
    for section in (DataConfig, SourceConfig):
        assert typing.get_args(typing.get_type_hints(section)["format"]) == tuple(FORMATS)


def test_prompts_keep_their_columns_for_the_rewards(tmp_path, tok):
    """data.format=prompt: text tokenized as it is, messages rendered with the generation prompt; the other
    columns ride along; a prompt longer than seq_len keeps its end; bad records are counted and named."""
    path = tmp_path / "prompts.jsonl"
    records = SAMPLES["prompt"] + [{"prompt": ""}, {"question": "no prompt"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    built = build(DataConfig(path=str(path), format="prompt", seq_len=128), tok, seed=0)
    assert (built.stats.num_examples, built.stats.skipped) == (2, 2)
    assert built.stats.reasons == {"field 'prompt' is empty": 1, "field 'prompt' is missing": 1}
    assert built.stats.first_bad == f"{path}, line 3: field 'prompt' is empty"
    batch = built.collate([built.train[0], built.train[1]])
    assert batch["prompts"] == [r["prompt"] for r in SAMPLES["prompt"]] and batch["prompt_index"].tolist() == [0, 1]
    assert batch["columns"] == [{"answer": "5"}, {"answer": "5"}]
    assert batch["prompt_ids"][0] == tok("Add 2 and 3.")["input_ids"]
    assert tok.decode(batch["prompt_ids"][1]).endswith("Add 2 and 3.<|eot_id|><|start_header_id|>assistant"
                                                       "<|end_header_id|>\n\n")
    short = build(DataConfig(path=str(path), format="prompt", seq_len=4), tok, seed=0)
    assert short.collate([short.train[0]])["prompt_ids"] == [tok("Add 2 and 3.")["input_ids"][-4:]]
