"""The data formats: FORMATS names each one (data.format, data.sources[i].format) with what it does: its
encoder (record -> tokens), the kind of rows it makes (Rows: tokens packed into rows of data.seq_len, or
preference pairs collated per micro-batch,
prompts for online RL), whether packing cuts its examples, whether it needs a chat
template. A new format is one entry here plus its encoder (and the name in config.py's FormatName).

The token formats' encoders are here: record -> (input_ids, labels), labels[i] is input_ids[i] where token i
carries a loss, else IGNORE. Bad records raise BadRecord with the reason; the caller counts/skips them or
stops (data.strict)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from jinja2 import TemplateError

from llmtrain.config import DataConfig
from llmtrain.data.preference import Pair, collate_pairs, encode_preference
from llmtrain.data.records import IGNORE, BadRecord, parse_turns, text_field
from llmtrain.data.unpaired import KL_COMPLETION, Unpaired, collate_unpaired, encode_unpaired

# Used when a tokenizer has no chat template. {% generation %} marks what the assistant says, so
# transformers returns the trained-token mask from the rendering itself.
DEFAULT_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}{%- generation %}{{- message['content'] + eos_token }}"
    "{%- endgeneration %}{%- else %}{{- message['content'] + eos_token }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def encode_text(record: dict, section: DataConfig, tokenizer) -> tuple[list[int], list[int]]:
    text = text_field(record, section.text_field)
    if not text:
        raise BadRecord(f"field {section.text_field!r} is empty")
    ids = tokenizer(text)["input_ids"]  # the tokenizer's own special-token convention (BOS or not)
    if not ids or ids[-1] != tokenizer.eos_token_id:
        ids = ids + [tokenizer.eos_token_id]
    return ids, list(ids)


def encode_instruction(record: dict, section: DataConfig, tokenizer) -> tuple[list[int], list[int]]:
    instruction = text_field(record, section.instruction_field)
    output = text_field(record, section.output_field)
    extra = record.get(section.input_field) or ""
    if not isinstance(extra, str):
        raise BadRecord(f"field {section.input_field!r} is {type(extra).__name__}, not text")
    if not instruction or not output:
        raise BadRecord(f"empty {section.instruction_field if not instruction else section.output_field!r}")
    template = section.prompt_template if extra else section.prompt_template_no_input
    prompt = tokenizer(template.format(instruction=instruction, input=extra))["input_ids"]
    response = tokenizer(output, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = prompt + response
    labels = ids if section.train_on_prompt else [IGNORE] * len(prompt) + response
    return ids, list(labels)


def chat_messages(record: dict, section: DataConfig) -> list[dict]:
    """OpenAI `messages` as they are; ShareGPT `conversations` mapped onto them; validated."""
    if section.messages_field in record and record[section.messages_field] is not None:
        messages = parse_turns(record[section.messages_field])
    elif record.get("conversations") is not None:
        messages = parse_turns(record["conversations"], "from", "value")
    else:
        raise BadRecord(f"no {section.messages_field!r} (or ShareGPT 'conversations') field")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no assistant turn")
    return messages


def tool_conversation(record: dict, section: DataConfig) -> tuple[list[dict], list[dict]] | None:
    """A tool-calling conversation (TRL's SFT format): a `tools` column (JSON schemas, or their JSON text),
    assistant messages carrying `tool_calls`, `tool` messages -> (messages, tools); None for a plain chat."""
    raw, tools = record.get(section.messages_field), record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise BadRecord(f"field 'tools' is not JSON: {e.msg}") from None
    calling = isinstance(raw, list) and any(isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls"))
                                           for m in raw)
    if tools is None and not calling:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRecord("field 'tools' must be a list of JSON schemas (transformers' get_json_schema)")
    if not isinstance(raw, list) or not raw:
        raise BadRecord(f"no {section.messages_field!r} field")
    messages = []
    for turn in raw:
        role = turn.get("role") if isinstance(turn, dict) else None
        if role not in ("system", "user", "assistant", "tool"):
            raise BadRecord(f"unknown role {role!r}" if isinstance(turn, dict) else "a turn is not a mapping")
        calls = turn.get("tool_calls") if role == "assistant" else None
        if calls is not None and not (isinstance(calls, list) and all(
                isinstance(c, dict) and isinstance(c.get("function", {}).get("name"), str) for c in calls)):
            raise BadRecord("an assistant turn's tool_calls must be [{'type': 'function', 'function': {'name': ..., "
                            "'arguments': {...}}}, ...]")
        if not isinstance(turn.get("content"), str) and not calls:
            raise BadRecord(f"a {role} turn has no text 'content'")
        messages.append({k: v for k, v in turn.items() if k in ("role", "content", "tool_calls", "name")})
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no assistant turn")
    return messages, tools


def encode_chat(record: dict, section: DataConfig, tokenizer) -> tuple[list[int], list[int]]:
    """The tokenizer's chat template renders the conversation; the trained tokens are read from that
    same rendering: from its {% generation %} blocks when it has them, else by locating each assistant
    message in the rendered text (token offsets), plus the end-of-turn token that closes it. A tool-calling
    conversation (tool_conversation) is rendered with tools= and needs the blocks: the assistant's calls and
    answers are trained, the tool results are not."""
    tooled = tool_conversation(record, section)
    if tooled is not None:
        return _encode_tool_chat(*tooled, section, tokenizer)
    messages = chat_messages(record, section)
    try:
        if GENERATION_BLOCK.search(tokenizer.chat_template):
            out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
            ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        else:
            ids, mask = _mask_by_offsets(messages, tokenizer)
    except TemplateError as e:  # the family's own rule, e.g. Gemma2 and Mistral have no system role
        raise BadRecord(f"the chat template refuses this conversation: {e}") from None
    if not any(mask):
        raise BadRecord("the chat template rendered no assistant tokens")
    labels = list(ids) if section.train_on_prompt else [t if m else IGNORE for t, m in zip(ids, mask)]
    return ids, labels


def _encode_tool_chat(messages: list[dict], tools: list[dict], section: DataConfig,
                      tokenizer) -> tuple[list[int], list[int]]:
    template = tokenizer.chat_template
    if "tool_calls" not in template or not GENERATION_BLOCK.search(template):
        raise BadRecord("a tool-calling conversation needs a chat template that renders tool_calls and marks the "
                        "assistant's turns with {% generation %}; set data.chat_template (e.g. "
                        "configs/templates/llama3-tools.jinja or chatml-tools.jinja)")
    try:
        out = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    except TemplateError as e:
        raise BadRecord(f"the chat template refuses this conversation: {e}") from None
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    if not any(mask):
        raise BadRecord("the chat template rendered no assistant tokens")
    return ids, list(ids) if section.train_on_prompt else [t if m else IGNORE for t, m in zip(ids, mask)]


def _mask_by_offsets(messages: list[dict], tokenizer) -> tuple[list[int], list[int]]:
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans, cursor = [], 0
    for m in messages:
        content = m["content"] if m["content"] in text[cursor:] else m["content"].strip()
        start = text.find(content, cursor)
        if start < 0:
            raise BadRecord(f"the chat template altered a {m['role']} message beyond recognition")
        cursor = start + len(content)
        if m["role"] == "assistant":
            spans.append((start, cursor))
    special = set(tokenizer.all_special_ids)
    ids = list(enc["input_ids"])
    mask = [int(any(a < end and b > start for start, end in spans)) for a, b in enc["offset_mapping"]]
    # The end-of-turn token right after each assistant message is trained too: it teaches stopping.
    closers = [i for i in range(1, len(ids)) if mask[i - 1] and not mask[i] and ids[i] in special]
    for i in closers:
        mask[i] = 1
    return ids, mask


def encode_prompt(record: dict, section: DataConfig, tokenizer) -> tuple[list[int], Any, dict]:
    """A prompt for online RL (recipes/grpo.py): {"prompt": text or messages, ...other columns} -> (prompt ids,
    the prompt as written, the other columns, which reach the reward functions). Text is tokenized as it is
    (the tokenizer's special tokens, e.g. BOS); messages are rendered with the chat template and its
    generation prompt."""
    prompt = record.get("prompt")
    if isinstance(prompt, list):
        prompt = parse_turns(prompt)
        try:
            ids = tokenizer.apply_chat_template(prompt, tokenize=True, return_dict=True,
                                                add_generation_prompt=True)["input_ids"]
        except TemplateError as e:
            raise BadRecord(f"the chat template refuses this conversation: {e}") from None
    elif isinstance(prompt, str) and prompt.strip():
        ids = tokenizer(prompt)["input_ids"]
    else:
        raise BadRecord("field 'prompt' is " + ("empty" if isinstance(prompt, str) else
                        "missing" if prompt is None else f"{type(prompt).__name__}, not text or a list of messages"))
    # A column this record lacks reads None (the rows share one schema); the recipe passes None for it too.
    return list(ids), prompt, {k: v for k, v in record.items() if k != "prompt" and v is not None}


@dataclass(frozen=True)
class Rows:
    """A kind of rows (what a recipe trains on): the columns an encoded record is stored as, and how those
    examples become training rows and a micro-batch of rows becomes tensors."""
    name: str
    columns: Callable[[Any, Format, DataConfig], dict]
    """(the encoder's result, its format, data section) -> the example's columns, a bool "truncated" among them."""
    empty: dict
    """The columns of a bad record (it is counted, then dropped)."""
    packs: bool
    """Examples are (input_ids, labels), packed or padded into rows of data.seq_len by packing.py (so they can
    also stream); else each example is a row of its own and `collate` pads a micro-batch of them."""
    parts: Callable[[dict], list[RowPart]]
    """A stored row -> its named token sequences with their trained spans, for `python -m llmtrain.data`."""
    collate: Callable[[list[dict], int], dict[str, torch.Tensor]] | None = None
    """(rows, pad id) -> a micro-batch; None: the rows have one length and are stacked as they are."""
    index: str | None = None
    """A column numbering the training rows, carried into their batches (pairs: precomputed reference
    log-probs are looked up by it, llmtrain/train/reference_cache.py)."""
    shown: Callable[[dict], dict] | None = None
    """A stored row -> its other columns `python -m llmtrain.data` prints beside its tokens (a prompt's columns,
    which reach the reward functions)."""


class RowPart(NamedTuple):
    """One token sequence of a row as the data inspector shows it: labels[i] != IGNORE where token i is trained."""
    name: str
    ids: list[int]
    labels: list[int]


@dataclass(frozen=True)
class Format:
    """One value of data.format (and data.sources[i].format)."""
    name: str
    encode: Callable[[dict, DataConfig, Any], Any]
    """(record, data section, tokenizer) -> what `rows.columns` stores; raises BadRecord for a bad record."""
    rows: Rows
    splits: bool = False
    """Packing cuts this format's examples across rows (documents) instead of truncating them to data.seq_len."""
    chat_template: bool = False
    """The encoder renders with the tokenizer's chat template (prepare_tokenizer supplies a default)."""


def _token_columns(encoded: tuple[list[int], list[int]], fmt: Format, section: DataConfig) -> dict:
    ids, labels = encoded
    return {"input_ids": ids, "labels": labels, "split": fmt.splits,
            "truncated": len(ids) > section.seq_len and not (fmt.splits and section.packing)}


def _pair_columns(pair: Pair, fmt: Format, section: DataConfig) -> dict:
    return {"prompt_ids": pair.prompt, "chosen_ids": pair.chosen, "rejected_ids": pair.rejected,
            "truncated": pair.truncated, "margin": pair.margin}


def _unpaired_columns(row: Unpaired, fmt: Format, section: DataConfig) -> dict:
    return {"prompt_ids": row.prompt, "completion_ids": row.completion, "label": row.label,
            "truncated": row.truncated}


PAIR_INDEX = "pair_index"
SAMPLE_INDEX = "sample_index"  # a training micro-batch's samples' indices in their step's global batch ([B] long):
                               # the same for any world size and split (they key LoRA's dropout masks)
PROMPT_INDEX = "prompt_index"
MODEL_INPUT = "model_input."  # a micro-batch's other tensors for the model's forward, by their argument's name
                              # after this prefix (a VLM processor's pixel_values, attention_mask: data/vision.py)


def model_inputs(batch: dict) -> dict:
    """What the model's forward takes from a micro-batch of token rows: the ids, their positions when the rows
    carry them (packed or padded text rows), and every MODEL_INPUT tensor."""
    inputs = {"input_ids": batch["input_ids"]}
    if "position_ids" in batch:
        inputs["position_ids"] = batch["position_ids"]
    return {**inputs, **{k[len(MODEL_INPUT):]: v for k, v in batch.items() if k.startswith(MODEL_INPUT)}}


def _prompt_columns(encoded: tuple[list[int], Any, dict], fmt: Format, section: DataConfig) -> dict:
    """A prompt longer than data.seq_len keeps its last seq_len tokens (TRL's max_prompt_length); labels are
    all IGNORE (a prompt trains nothing) so that the rows read like token rows (python -m llmtrain.data)."""
    ids, prompt, columns = encoded
    kept = ids[-section.seq_len:]
    return {"input_ids": kept, "labels": [IGNORE] * len(kept), "position_ids": list(range(len(kept))),
            # JSON text: a prompt may be text or messages, and the columns anything (one Arrow type each)
            "prompt_json": json.dumps(prompt), "columns_json": json.dumps(columns), "truncated": len(ids) > len(kept)}


def _collate_prompts(rows: list[dict], pad_id: int) -> dict:
    """Prompt rows -> their ids (lists: generation pads them itself), the prompts as written, the other
    columns (dicts) and their positions in the training rows (PROMPT_INDEX; the sampling keys use them)."""
    return {"prompt_ids": [r["input_ids"].tolist() for r in rows],
            "prompts": [json.loads(r["prompt_json"]) for r in rows],
            "columns": [json.loads(r["columns_json"]) for r in rows],
            PROMPT_INDEX: torch.stack([r[PROMPT_INDEX] for r in rows])}


def _collate_pair_rows(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Stored pairs (torch-formatted rows) -> collate_pairs' batch, with their pair_index when they have one."""
    batch = collate_pairs([Pair(r["prompt_ids"].tolist(), r["chosen_ids"].tolist(), r["rejected_ids"].tolist(),
                                False, float(r["margin"])) for r in rows], pad_id)
    return {**batch, PAIR_INDEX: torch.stack([r[PAIR_INDEX] for r in rows])} if PAIR_INDEX in rows[0] else batch


def _collate_unpaired_rows(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Stored unpaired rows -> collate_unpaired's batch, with their pair_index (a row and its KL row) when they
    have one."""
    batch = collate_unpaired(rows, pad_id)
    return {**batch, PAIR_INDEX: torch.stack([r[PAIR_INDEX] for r in rows])} if PAIR_INDEX in rows[0] else batch


def _unpaired_parts(row: dict) -> list[RowPart]:
    """The prompt conditions; the completion is scored (desirable or not), and so is the KL completion beside
    the prompt once the recipe has added it."""
    prompt, completion = list(map(int, row["prompt_ids"])), list(map(int, row["completion_ids"]))
    side = "desirable" if bool(row["label"]) else "undesirable"
    parts = [RowPart("prompt", prompt, [IGNORE] * len(prompt)), RowPart(side, completion, completion)]
    if KL_COMPLETION in row:
        kl = list(map(int, row[KL_COMPLETION]))
        parts.append(RowPart("kl", kl, kl))
    return parts


def _pair_parts(row: dict) -> list[RowPart]:
    """The prompt conditions; both responses are trained (their log-probs make the preference loss)."""
    prompt, chosen, rejected = (list(map(int, row[c])) for c in ("prompt_ids", "chosen_ids", "rejected_ids"))
    return [RowPart("prompt", prompt, [IGNORE] * len(prompt)), RowPart("chosen", chosen, chosen),
            RowPart("rejected", rejected, rejected)]


def _prompt_parts(row: dict) -> list[RowPart]:
    """A prompt conditions the completions and trains nothing itself."""
    ids = list(map(int, row["input_ids"]))
    return [RowPart("prompt", ids, [IGNORE] * len(ids))]


TOKENS = Rows("tokens", _token_columns, {"input_ids": [], "labels": [], "split": False, "truncated": False},
              packs=True, parts=lambda row: [RowPart("", list(map(int, row["input_ids"])),
                                                     list(map(int, row["labels"])))])
PAIRS = Rows("pairs", _pair_columns, {"prompt_ids": [], "chosen_ids": [], "rejected_ids": [], "truncated": False,
                                      "margin": 0.0},
             packs=False, parts=_pair_parts, collate=_collate_pair_rows, index=PAIR_INDEX)
UNPAIRED = Rows("unpaired", _unpaired_columns, {"prompt_ids": [], "completion_ids": [], "label": False,
                                               "truncated": False},
                packs=False, parts=_unpaired_parts, collate=_collate_unpaired_rows, index=PAIR_INDEX)
PROMPTS = Rows("prompts", _prompt_columns, {"input_ids": [], "labels": [], "position_ids": [], "prompt_json": "null",
                                            "columns_json": "{}", "truncated": False},
               packs=False, parts=_prompt_parts, collate=_collate_prompts, index=PROMPT_INDEX,
               shown=lambda row: json.loads(row["columns_json"]))

FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("text", encode_text, TOKENS, splits=True),
    Format("instruction", encode_instruction, TOKENS),
    Format("chat", encode_chat, TOKENS, chat_template=True),
    Format("preference", encode_preference, PAIRS, chat_template=True),
    Format("unpaired", encode_unpaired, UNPAIRED, chat_template=True),
    Format("prompt", encode_prompt, PROMPTS, chat_template=True),
)}


DEFAULT_MARKERS = ("<|start_header_id|>", "<|end_header_id|>")


def prepare_tokenizer(tokenizer, formats: set[str], template: str | None = None) -> str | None:
    """When one of these formats needs a chat template: `template` (data.chat_template's text) if given, else
    the tokenizer's own, else DEFAULT_CHAT_TEMPLATE. Returns a line for the start-up log when it is not the
    tokenizer's own template, saying what that means."""
    if not any(FORMATS[f].chat_template for f in formats):
        return None
    if template is not None:
        tokenizer.chat_template = template
        return "chat template: data.chat_template (not the tokenizer's own)"
    if tokenizer.chat_template:
        return None
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    plain = [m for m in DEFAULT_MARKERS if m not in tokenizer.get_vocab()]
    meaning = (f"its markers {' '.join(plain)} are not special tokens of this tokenizer and are learned as plain "
               "text (several tokens each)") if plain else "its markers are tokens of this tokenizer"
    return (f"chat template: the tokenizer has none, so llmtrain's default (Llama 3 style) is used: {meaning}; "
            "set data.chat_template (a Jinja template, or a .jinja/.json file) to choose one")
