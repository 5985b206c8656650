"""Preference pairs (data.format: preference) -> prompt, chosen and rejected token ids; and the collate
that puts a micro-batch's chosen rows, then its rejected rows, into one batch (one forward for both).

Two record forms, as in the public preference datasets and TRL:
  text      {"prompt": str, "chosen": str, "rejected": str}. The prompt is tokenized as it is (with the
            tokenizer's own special tokens, e.g. BOS), each response on its own plus EOS, so the token
            boundary is the one generation sees. No chat template: such prompts carry their own format.
  messages  {"chosen": [messages], "rejected": [messages]} with an optional shared "prompt": [messages];
            without it, the prompt is the leading turns the two lists share. The chat template renders
            the prompt (with the generation prompt) and prompt + response; a response is every token after
            the longest prefix both renderings share with the prompt's (TRL's rule: some templates render
            a prompt alone differently), end-of-turn tokens included.

Truncation to seq_len (prompt + chosen and prompt + rejected must each fit): first the prompt loses
tokens from its start (a leading BOS stays), only as many as needed but never below half of seq_len;
then each response loses tokens from its end. A truncated pair is kept and counted (Pair.truncated).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from jinja2 import TemplateError

from llmtrain.config import DataConfig
from llmtrain.data.records import IGNORE, BadRecord, parse_turns, text_field


class Pair(NamedTuple):
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    truncated: bool
    margin: float = 0.0  # the optional "margin" column (a reward model's target gap, TRL's), 0 without one


def encode_preference(record: dict, section: DataConfig, tokenizer) -> Pair:
    if isinstance(record.get("chosen"), list):
        prompt, chosen, rejected = _message_ids(record, tokenizer)
    elif isinstance(record.get("chosen"), str):
        prompt, chosen, rejected = _text_ids(record, tokenizer)
    else:
        value = record.get("chosen")
        raise BadRecord(f"field 'chosen' is {'missing' if value is None else type(value).__name__}, "
                        "not text or a list of messages")
    if not prompt:
        raise BadRecord("the prompt has no tokens: nothing to condition the responses on")
    if chosen == rejected:
        raise BadRecord("chosen and rejected are identical")
    return truncate(prompt, chosen, rejected, section.seq_len, tokenizer.bos_token_id)._replace(margin=_margin(record))


def _margin(record: dict) -> float:
    value = record.get("margin", 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRecord(f"field 'margin' is {value!r}, not a finite number")
    return float(value)


def _text_ids(record: dict, tokenizer) -> tuple[list[int], list[int], list[int]]:
    prompt = text_field(record, "prompt")
    responses = []
    for name in ("chosen", "rejected"):
        text = text_field(record, name)
        if not text.strip():
            raise BadRecord(f"empty {name!r}")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        responses.append(ids if ids[-1] == tokenizer.eos_token_id else ids + [tokenizer.eos_token_id])
    return tokenizer(prompt)["input_ids"], *responses


def _message_ids(record: dict, tokenizer) -> tuple[list[int], list[int], list[int]]:
    if not isinstance(record.get("rejected"), list):
        raise BadRecord("'chosen' is a list of messages but 'rejected' is not; use one form for both")
    chosen, rejected = parse_turns(record["chosen"]), parse_turns(record["rejected"])
    if record.get("prompt") is None:
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    elif isinstance(record["prompt"], list):
        prompt = parse_turns(record["prompt"])
    else:
        raise BadRecord("'prompt' is text but 'chosen' and 'rejected' are messages; make it a list of messages")
    if not prompt:
        raise BadRecord("no prompt: no 'prompt' field, and 'chosen' and 'rejected' share no leading turn")
    for name, response in (("chosen", chosen), ("rejected", rejected)):
        if not response:
            raise BadRecord(f"{name!r} has no turn after the prompt")
        if response[0]["role"] != "assistant":
            raise BadRecord(f"the {name!r} response starts with a {response[0]['role']} turn, not an assistant one")
        if not any(m["content"].strip() for m in response if m["role"] == "assistant"):
            raise BadRecord(f"empty {name!r} response")

    def render(messages: list[dict], generation_prompt: bool = False) -> list[int]:
        return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                  add_generation_prompt=generation_prompt)["input_ids"])

    try:
        prompt_ids = render(prompt, generation_prompt=True)
        with_chosen, with_rejected = render(prompt + chosen), render(prompt + rejected)
    except TemplateError as e:  # a family's own rule, e.g. no system role
        raise BadRecord(f"the chat template refuses this conversation: {e}") from None
    n = min(_shared_prefix(prompt_ids, with_chosen), _shared_prefix(prompt_ids, with_rejected))
    return prompt_ids[:n], with_chosen[n:], with_rejected[n:]


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def truncate(prompt: list[int], chosen: list[int], rejected: list[int], seq_len: int, bos_id: int | None) -> Pair:
    """The module docstring's rule: prompt from the left (down to half of seq_len), then responses from the right."""
    longest = max(len(chosen), len(rejected))
    if len(prompt) + longest <= seq_len:
        return Pair(prompt, chosen, rejected, False)
    keep = max(seq_len - longest, min(len(prompt), max(1, seq_len // 2)))
    if keep < len(prompt):
        head = prompt[:1] if keep > 1 and prompt[0] == bos_id else []
        prompt = head + prompt[len(prompt) - (keep - len(head)):]
    room = seq_len - len(prompt)
    chosen, rejected = chosen[:room], rejected[:room]
    if chosen == rejected:
        raise BadRecord("chosen and rejected differ only beyond data.seq_len")
    return Pair(prompt, chosen, rejected, True)


def collate_pairs(pairs: list[Pair], pad_id: int) -> dict[str, torch.Tensor]:
    """B pairs -> rows [chosen_1..chosen_B, rejected_1..rejected_B], right-padded to the longest row:
    input_ids, labels (IGNORE outside the responses) and position_ids. Pads follow their row's positions:
    attention is causal, so no real token sees them, and an unpacked row needs no block mask."""
    sequences = [(p.prompt, p.chosen) for p in pairs] + [(p.prompt, p.rejected) for p in pairs]
    length = max(len(prompt) + len(response) for prompt, response in sequences)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    labels = torch.full((len(sequences), length), IGNORE, dtype=torch.long)
    for row, (prompt, response) in enumerate(sequences):
        ids = torch.as_tensor([*prompt, *response], dtype=torch.long)
        input_ids[row, :len(ids)] = ids
        labels[row, len(prompt):len(ids)] = ids[len(prompt):]
    return {"input_ids": input_ids, "labels": labels,
            "position_ids": torch.arange(length).repeat(len(sequences), 1),
            "margin": torch.tensor([p.margin for p in pairs], dtype=torch.float32)}
