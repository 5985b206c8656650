"""Which chat template the chat formats render with: data.chat_template (Jinja text, a .jinja file or
a .json file) chooses it; a tokenizer without one gets llmtrain's default, said at start-up with what it means."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from helpers import REPO
from llmtrain.config import ConfigError, DataConfig
from llmtrain.data import build, chat_template, check
from llmtrain.data.formats import DEFAULT_CHAT_TEMPLATE, prepare_tokenizer
from llmtrain.models.hf import load_tokenizer

CHAT = str(REPO / "data" / "demo" / "chat.jsonl")
MINE = ("{%- for message in messages %}{{- 'USER: ' if message['role'] == 'user' else 'BOT: ' }}"
        "{%- if message['role'] == 'assistant' %}{%- generation %}{{- message['content'] + eos_token }}"
        "{%- endgeneration %}{%- else %}{{- message['content'] + eos_token }}{%- endif %}{%- endfor %}")


def bare_tokenizer() -> PreTrainedTokenizerFast:
    """A real tokenizer with no chat template and none of the default template's markers."""
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[UNK]")


def test_no_template_takes_the_default_and_says_its_markers_are_plain_text():
    tok = bare_tokenizer()
    note = prepare_tokenizer(tok, {"chat"})
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE
    assert note.startswith("chat template: the tokenizer has none, so llmtrain's default (Llama 3 style) is used: "
                           "its markers <|start_header_id|> <|end_header_id|> are not special tokens of this "
                           "tokenizer and are learned as plain text")
    assert "set data.chat_template" in note
    assert prepare_tokenizer(bare_tokenizer(), {"text"}) is None  # no chat format: nothing to say
    own = load_tokenizer(str(REPO / "assets" / "tokenizer"), False)
    assert prepare_tokenizer(own, {"chat"}) is None  # the tokenizer's own template: nothing to say


def test_the_chat_template_key_takes_text_a_jinja_file_or_a_json_file(tmp_path):
    (tmp_path / "t.jinja").write_text(MINE)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": MINE}))
    (tmp_path / "named.json").write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "x"},
                                                                       {"name": "default", "template": MINE}]}))
    for value in (MINE, tmp_path / "t.jinja", tmp_path / "tokenizer_config.json", tmp_path / "named.json"):
        assert chat_template(DataConfig(path=CHAT, format="chat", chat_template=str(value))) == MINE
    (tmp_path / "empty.json").write_text("{}")
    for value, says in ((tmp_path / "missing.jinja", "no such file"), (tmp_path / "empty.json", "no chat_template")):
        with pytest.raises(ConfigError, match=f"data.chat_template: .*{says}"):
            check(DataConfig(path=CHAT, format="chat", chat_template=str(value)))


def test_the_chosen_template_renders_the_rows():
    tok = load_tokenizer(str(REPO / "assets" / "tokenizer"), False)
    built = build(DataConfig(path=CHAT, format="chat", seq_len=128, chat_template=MINE), tok, seed=0)
    assert built.stats.template_note == "chat template: data.chat_template (not the tokenizer's own)"
    text = tok.decode(list(built.train[0]["input_ids"]))
    assert "USER: " in text and "BOT: " in text and "<|start_header_id|>" not in text
    assert tok.chat_template == MINE  # the export saves the tokenizer: it carries the template trained with
