"""Unpaired preference rows (data.format: unpaired; recipes/kto.py): TRL's unpaired preference format, one
completion per record with a thumbs-up or thumbs-down, and the collate that puts a micro-batch's rows and their
mismatched (KL) rows side by side.

Two record forms, as TRL's KTOTrainer reads them:
  text      {"prompt": str, "completion": str, "label": bool}. The prompt is tokenized as it is (the tokenizer's
            special tokens, e.g. BOS), the completion on its own plus EOS (TRL adds EOS to a text completion).
  messages  {"prompt": [messages], "completion": [messages], "label": bool}: the chat template renders the prompt
            (with the generation prompt) and prompt + completion; the completion is every token after the longest
            prefix the two renderings share (TRL's rule).
label true: a desirable completion, false: an undesirable one; anything else is a bad record naming it.

Truncation to seq_len: the prompt loses tokens from its start (a leading BOS stays) down to half of seq_len, then
the completion from its end (llmtrain.data.preference.truncate's rule).

The KL rows (TRL's KL_completion_ids): each row's prompt with another row's completion. They are fixed per stored
row, TRL's rotation: within consecutive chunks of `chunk` rows in stored order, row i takes row i-1's completion
(the chunk's first row its last one's); with_kl_completions adds them as a column, so they travel with their row
through the shuffled order, any world size or split, a resume and the precomputed reference."""

from __future__ import annotations

from typing import NamedTuple

import torch
from jinja2 import TemplateError

from llmtrain.config import DataConfig
from llmtrain.data.preference import truncate
from llmtrain.data.records import IGNORE, BadRecord, parse_turns, text_field

KL_COMPLETION = "kl_completion_ids"


class Unpaired(NamedTuple):
    prompt: list[int]
    completion: list[int]
    label: bool
    truncated: bool


def encode_unpaired(record: dict, section: DataConfig, tokenizer) -> Unpaired:
    label = record.get("label")
    if not isinstance(label, bool):
        raise BadRecord("no field 'label' (true: a desirable completion, false: an undesirable one)" if label is None
                        else f"field 'label' is {label!r} ({type(label).__name__}), not true or false")
    if isinstance(record.get("completion"), list):
        prompt, completion = _message_ids(record, tokenizer)
    else:
        prompt = tokenizer(text_field(record, "prompt"))["input_ids"]
        text = text_field(record, "completion")
        if not text.strip():
            raise BadRecord("empty 'completion'")
        completion = tokenizer(text, add_special_tokens=False)["input_ids"]
        completion = completion if completion[-1] == tokenizer.eos_token_id else completion + [tokenizer.eos_token_id]
    if not prompt:
        raise BadRecord("the prompt has no tokens: nothing to condition the completion on")
    # The pair rule with one response: the prompt from the left, then the completion from the right.
    cut = truncate(prompt, completion, [], section.seq_len, tokenizer.bos_token_id)
    return Unpaired(cut.prompt, cut.chosen, label, cut.truncated)


def _message_ids(record: dict, tokenizer) -> tuple[list[int], list[int]]:
    if not isinstance(record.get("prompt"), list):
        raise BadRecord("'completion' is a list of messages but 'prompt' is not; use one form for both")
    prompt, completion = parse_turns(record["prompt"]), parse_turns(record["completion"])
    if completion[0]["role"] != "assistant" or not any(m["content"].strip() for m in completion):
        raise BadRecord("the completion must start with a non-empty assistant turn")
    try:
        prompt_ids = list(tokenizer.apply_chat_template(prompt, tokenize=True, return_dict=True,
                                                        add_generation_prompt=True)["input_ids"])
        full = list(tokenizer.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)["input_ids"])
    except TemplateError as e:  # a family's own rule, e.g. no system role
        raise BadRecord(f"the chat template refuses this conversation: {e}") from None
    n = next((i for i, (a, b) in enumerate(zip(prompt_ids, full)) if a != b), min(len(prompt_ids), len(full)))
    return prompt_ids[:n], full[n:]


def with_kl_completions(rows, chunk: int, seq_len: int):
    """rows (a datasets.Dataset of stored unpaired rows) plus KL_COMPLETION: the module docstring's rotation within
    chunks of `chunk` rows, each mismatched completion cut from its end to fit data.seq_len beside its row's prompt
    (TRL truncates the KL sequence at max_length likewise)."""
    return rows.map(_rotate, batched=True, batch_size=chunk, fn_kwargs={"seq_len": seq_len}, desc="KL completions")


def _rotate(batch: dict, seq_len: int) -> dict:
    completions = batch["completion_ids"]
    rotated = completions[-1:] + completions[:-1]
    return {KL_COMPLETION: [other[:seq_len - len(prompt)] for prompt, other in zip(batch["prompt_ids"], rotated)]}


def collate_unpaired(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """B stored rows -> input_ids, labels (IGNORE outside the completions) and position_ids of the B rows, the same
    for their KL rows under kl_*, and label ([B] bool). Right-padded: causal attention, no real token sees a pad."""
    prompts = [r["prompt_ids"].tolist() for r in rows]
    batch = _padded(prompts, [r["completion_ids"].tolist() for r in rows], pad_id)
    if KL_COMPLETION in rows[0]:
        kl = _padded(prompts, [r[KL_COMPLETION].tolist() for r in rows], pad_id)
        batch |= {f"kl_{k}": v for k, v in kl.items()}
    return {**batch, "label": torch.stack([r["label"] for r in rows]).bool()}


def _padded(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    length = max(len(p) + len(c) for p, c in zip(prompts, completions))
    input_ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    labels = torch.full((len(prompts), length), IGNORE, dtype=torch.long)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        ids = torch.as_tensor([*prompt, *completion], dtype=torch.long)
        input_ids[row, :len(ids)] = ids
        labels[row, len(prompt):len(ids)] = ids[len(prompt):]
    return {"input_ids": input_ids, "labels": labels, "position_ids": torch.arange(length).repeat(len(prompts), 1)}
