"""Records -> (input_ids, labels). labels[i] is input_ids[i] where token i carries a loss, else IGNORE.
Bad records raise BadRecord with the reason; the caller counts/skips them or stops (data.strict)."""

from __future__ import annotations

import re

from jinja2 import TemplateError

from llmtrain.config import DataConfig

IGNORE = -100
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "bot": "assistant", "model": "assistant"}
# Used when a tokenizer has no chat template. {% generation %} marks what the assistant says, so
# transformers returns the trained-token mask from the rendering itself.
DEFAULT_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}{%- generation %}{{- message['content'] + eos_token }}"
    "{%- endgeneration %}{%- else %}{{- message['content'] + eos_token }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


class BadRecord(ValueError):
    pass


def _text_field(record: dict, name: str) -> str:
    value = record.get(name)
    if not isinstance(value, str):
        raise BadRecord(f"field {name!r} is {'missing' if value is None else type(value).__name__}, not text")
    return value


def encode_text(record: dict, section: DataConfig, tokenizer) -> tuple[list[int], list[int]]:
    text = _text_field(record, section.text_field)
    if not text:
        raise BadRecord(f"field {section.text_field!r} is empty")
    ids = tokenizer(text)["input_ids"]  # the tokenizer's own special-token convention (BOS or not)
    if not ids or ids[-1] != tokenizer.eos_token_id:
        ids = ids + [tokenizer.eos_token_id]
    return ids, list(ids)


def encode_instruction(record: dict, section: DataConfig, tokenizer) -> tuple[list[int], list[int]]:
    instruction = _text_field(record, section.instruction_field)
    output = _text_field(record, section.output_field)
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


def parse_turns(raw, role_key: str = "role", content_key: str = "content") -> list[dict]:
    """A list of turns -> validated {role, content} messages; role_key 'from' maps ShareGPT roles."""
    if not isinstance(raw, list) or not raw:
        raise BadRecord("empty conversation")
    messages = []
    for turn in raw:
        if not isinstance(turn, dict):
            raise BadRecord(f"a turn is {type(turn).__name__}, not a mapping")
        role = SHAREGPT_ROLES.get(turn.get(role_key)) if role_key == "from" else turn.get(role_key)
        if role not in ("system", "user", "assistant"):
            raise BadRecord(f"unknown role {turn.get(role_key)!r}")
        if not isinstance(turn.get(content_key), str):
            raise BadRecord(f"a {role} turn has no text {content_key!r}")
        messages.append({"role": role, "content": turn[content_key]})
    return messages


def encode_chat(record: dict, section: DataConfig, tokenizer) -> tuple[list[int], list[int]]:
    """The tokenizer's chat template renders the conversation; the trained tokens are read from that
    same rendering: from its {% generation %} blocks when it has them, else by locating each assistant
    message in the rendered text (token offsets), plus the end-of-turn token that closes it."""
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


ENCODERS = {"text": encode_text, "instruction": encode_instruction, "chat": encode_chat}


def prepare_tokenizer(tokenizer, formats: set[str]) -> None:
    """Chat and preference pairs need a template; a tokenizer without one gets DEFAULT_CHAT_TEMPLATE."""
    if formats & {"chat", "preference"} and not tokenizer.chat_template:
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
