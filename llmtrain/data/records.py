"""What every format's encoder shares: the ignored label, the bad-record error, and reading a record's
text fields and conversation turns. (Its own module so that formats.py, whose registry names the
preference encoder, and preference.py, which reads turns too, import it one way.)"""

from __future__ import annotations

IGNORE = -100
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "bot": "assistant", "model": "assistant"}


class BadRecord(ValueError):
    pass


def text_field(record: dict, name: str) -> str:
    value = record.get(name)
    if not isinstance(value, str):
        raise BadRecord(f"field {name!r} is {'missing' if value is None else type(value).__name__}, not text")
    return value


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
        if isinstance(turn.get(content_key), list):  # parts: images and text (TRL's vision-language shape)
            raise BadRecord(f"a {role} turn's {content_key!r} is a list of parts (images): model.path is a text-only "
                            "model; train a vision-language model on it (docs/vision.md)")
        if not isinstance(turn.get(content_key), str):
            raise BadRecord(f"a {role} turn has no text {content_key!r}")
        messages.append({"role": role, "content": turn[content_key]})
    return messages
