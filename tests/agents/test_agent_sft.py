"""SFT on tool-calling conversations (TRL's format: a `tools` column, assistant `tool_calls`, `tool` messages), in
process, for a Llama-3-style and a Qwen-style (ChatML, hermes) template given as data.chat_template: the assistant's
calls and answers are trained (with their end-of-turn token), the prompts and tool results are not; train_on_prompt
trains everything; GRPO renders the same conversation into the same ids (its prompt, the sampled turns, the tool
messages' suffix); a template that cannot render tool calls refuses the record in one line."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.agents import FORMAT, TEMPLATES, stop_ids, tokenizer

from llmtrain.config import DataConfig
from llmtrain.data.formats import IGNORE, encode_chat, prepare_tokenizer
from llmtrain.data.records import BadRecord
from llmtrain.rollout.agent import Agent
from llmtrain.rollout.tools import CallParser

SCHEMA = {"type": "function", "function": {"name": "lookup", "description": "Look a key up.", "parameters": {
    "type": "object", "properties": {"key": {"type": "string", "description": "the key"}}, "required": ["key"]}}}
CALL = {"type": "function", "function": {"name": "lookup", "arguments": {"key": "x"}}}
RECORD = {"messages": [{"role": "user", "content": "What is x?"},
                       {"role": "assistant", "content": "", "tool_calls": [CALL]},
                       {"role": "tool", "name": "lookup", "content": "42"},
                       {"role": "assistant", "content": "It is 42."}],
          "tools": json.dumps([SCHEMA])}
TRAINED = {"llama3": '{"name": "lookup", "parameters": {"key": "x"}}<|eot_id|>It is 42.<|eot_id|>',
           "chatml": '<tool_call>\n{"name": "lookup", "arguments": {"key": "x"}}\n</tool_call><|im_end|>'
                     'It is 42.<|im_end|>'}


def runs_of(labels: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of trained labels."""
    out, start = [], None
    for i, t in enumerate([*labels, IGNORE]):
        if t != IGNORE and start is None:
            start = i
        elif t == IGNORE and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.mark.parametrize("style", ["llama3", "chatml"])
def test_tool_conversation_masks(style):
    tok = tokenizer(style)
    note = prepare_tokenizer(tok, {"chat", "prompt"}, TEMPLATES[style].read_text())  # data.chat_template's text
    assert note == "chat template: data.chat_template (not the tokenizer's own)"
    ids, labels = encode_chat(RECORD, DataConfig(format="chat"), tok)
    assert tok.decode([t for t in labels if t != IGNORE]) == TRAINED[style]
    text = tok.decode(ids)
    assert '"description": "Look a key up."' in text and "42" in text.split("It is")[0]  # schema and result: context
    assert encode_chat(RECORD, DataConfig(format="chat", train_on_prompt=True), tok)[1] == ids
    # GRPO's rendering of the same conversation: prompt with tools=, the model's turns, the tool messages' suffix.
    stop = stop_ids(tok, style)
    agent = Agent(tok, CallParser(FORMAT[style], tok, stop), stop, tok.pad_token_id, None, 1.0, 1, torch.device("cpu"))
    (a, b), (c, d) = runs_of(labels)
    prompt = agent.prompt_ids(RECORD["messages"][:1], [type("T", (), {"schema": SCHEMA})()], 4096)
    assert ids[:d] == prompt + ids[a:b] + agent.suffix_ids([RECORD["messages"][2]]) + ids[c:d]
    assert ids[:a] == prompt and agent.parse(ids[a:b], ids[:a], [SCHEMA]).calls[0][:2] == ("lookup", {"key": "x"})


def test_a_template_without_tools_refuses_in_one_line():
    tok = tokenizer("llama3")
    tok.chat_template = (TEMPLATES["llama3"].parent.parent.parent / "assets" / "tokenizer" /
                         "chat_template.jinja").read_text()
    with pytest.raises(BadRecord, match=r"^a tool-calling conversation needs a chat template that renders "
                                        r"tool_calls .*; set data.chat_template"):
        encode_chat(RECORD, DataConfig(format="chat"), tok)
    with pytest.raises(BadRecord, match=r"^an assistant turn's tool_calls must be"):
        encode_chat({**RECORD, "messages": [RECORD["messages"][0], {"role": "assistant", "tool_calls": [{}]}]},
                    DataConfig(format="chat"), tok)
