"""Tools for multi-turn rollouts (grpo.tools, grpo.environment): plain Python functions (sync or async) with type
hints and Google-style docstrings, their JSON schemas as transformers makes them (get_json_schema, what a chat
template's tools= renders), the model's tool calls parsed from its sampled tokens (grpo.tool_call_format: PARSERS,
or the tokenizer's own response template), and the calls run: the rows' concurrently in a bounded pool, each
within grpo.tool_timeout_s. A call that raises, names an unknown tool, cannot be parsed or takes too long is a
failure fed back to the model as {"error": ...} (TRL's behaviour); the run goes on."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from transformers.utils import get_json_schema

from llmtrain.config import ConfigError
from llmtrain.rewards import load


class Tool(NamedTuple):
    name: str
    fn: Callable           # sync or async
    schema: dict           # get_json_schema's: what tools= renders


def as_tool(fn: Callable, key: str) -> Tool:
    """A function (or an environment's bound method) -> its Tool; a ConfigError naming `key` when transformers
    cannot make its schema (no type hints, no docstring, an undocumented argument)."""
    try:
        schema = get_json_schema(fn)
    except Exception as e:  # transformers' TypeHintParsingException, DocstringParsingException
        raise ConfigError(f"{key}: {getattr(fn, '__qualname__', fn)!r} cannot be a tool: {e} (a tool needs type "
                          "hints and a Google-style docstring with an Args: section)") from None
    return Tool(schema["function"]["name"], fn, schema)


def load_tools(specs: list[str], key: str = "grpo.tools") -> list[Tool]:
    """grpo.tools' functions ("path/to/file.py:function" or "package.module:function"), at set-up; names unique."""
    tools = [as_tool(load(spec, f"{key}[{i}]").fn, f"{key}[{i}]") for i, spec in enumerate(specs)]
    unique(tools, key)
    return tools


def unique(tools: list[Tool], key: str) -> None:
    names = [t.name for t in tools]
    if dup := next((n for n in names if names.count(n) > 1), None):
        raise ConfigError(f"{key}: two tools named {dup!r}; the model calls tools by name")


def methods(instance: object, key: str) -> list[Tool]:
    """An environment's tools: its public methods other than reset and get_reward (TRL's rule)."""
    return [as_tool(getattr(instance, n), key) for n, v in inspect.getmembers(type(instance), inspect.isfunction)
            if not n.startswith("_") and n not in ("reset", "get_reward")]


# -- parsing the model's calls -------------------------------------------------------------------------------------

class ToolCall(NamedTuple):
    name: str
    arguments: dict
    error: str | None = None   # the call could not be parsed (then it is a failure, fed back as {"error": ...})

    def message(self) -> dict:
        """The assistant message's tool_calls entry (transformers' chat format)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class Parsed(NamedTuple):
    content: str               # the text beside the calls
    calls: list[ToolCall]


def _call(obj: Any, args_key: str) -> ToolCall:
    """One decoded JSON call -> a ToolCall (an error one when it is not {"name": str, args_key: mapping})."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("unknown", {}, f"a tool call must be a JSON object with a 'name'; got {json.dumps(obj)[:80]}")
    arguments = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(obj["name"], {}, f"the arguments of {obj['name']!r} are not a JSON object")
    return ToolCall(obj["name"], arguments)


def _loads(text: str) -> tuple[Any, str | None]:
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"a tool call is not valid JSON ({e.msg} at {e.pos}): {text.strip()[:80]}"


HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)


def parse_hermes(text: str) -> Parsed:
    """Qwen / Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number of them."""
    calls = []
    for body, closed in HERMES.findall(text):
        obj, error = _loads(body) if closed else (None, f"an unclosed <tool_call>: {body.strip()[:80]}")
        calls.append(ToolCall("unknown", {}, error) if error else _call(obj, "arguments"))
    return Parsed(text.split("<tool_call>")[0].strip(), calls)


def parse_llama3_json(text: str) -> Parsed:
    """Llama 3.x JSON tool calling: the whole message is {"name": ..., "parameters": {...}} (after an optional
    <|python_tag|>); several calls are separated by ';'. A message not starting with '{' is an answer."""
    body = text.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return Parsed(text.strip(), [])
    calls = []
    for part in _split_objects(body):
        obj, error = _loads(part)
        calls.append(ToolCall("unknown", {}, error) if error else _call(obj, "parameters"))
    return Parsed("", calls)


def _split_objects(body: str) -> list[str]:
    """'{...}; {...}' -> the objects' texts (a ';' inside a JSON string does not split)."""
    parts, depth, start, quoted, escaped = [], 0, 0, False, False
    for i, ch in enumerate(body):
        if quoted:
            quoted, escaped = (not (ch == '"' and not escaped)), (ch == "\\" and not escaped)
        elif ch == '"':
            quoted = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    return [p for p in [*parts, body[start:]] if p.strip()]


PARSERS: dict[str, Callable[[str], Parsed]] = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


class CallParser:
    """grpo.tool_call_format: auto (the tokenizer's response template, transformers' parse_response, given the
    prompt and turns before it and the row's tools' schemas, as TRL calls it) or one of PARSERS on the turn's text
    (its stop token left out). Called on the ids one turn sampled."""

    def __init__(self, fmt: str, tokenizer, stop_ids: list[int]):
        if fmt == "auto" and getattr(tokenizer, "response_template", None) is None:  # what parse_response reads
            raise ConfigError("grpo.tool_call_format: auto reads the tokenizer's response template and this tokenizer "
                              f"has none; choose one of {', '.join(PARSERS)}")
        self.fmt, self.tokenizer, self.stop = fmt, tokenizer, set(stop_ids)

    def __call__(self, ids: list[int], prefix: list[int], tools: list[dict]) -> Parsed:
        if self.fmt == "auto":
            message = self.tokenizer.parse_response(ids, prefix=prefix, tools=tools or None)
            calls = [_call({"name": c["function"]["name"], "arguments": c["function"].get("arguments", {})},
                           "arguments") for c in message.get("tool_calls") or []]
            return Parsed(message.get("content") or "", calls)
        body = ids[:-1] if ids and ids[-1] in self.stop else ids
        return PARSERS[self.fmt](self.tokenizer.decode(body, skip_special_tokens=False))


# -- running them --------------------------------------------------------------------------------------------------

class Outcome(NamedTuple):
    name: str
    result: Any            # what goes into the tool message: the tool's return value or {"error": ...}
    failed: bool

    def message(self) -> dict:
        """The tool message, its content str(result) as TRL 1.16 writes it (so {'error': '...'} for a failure)."""
        return {"role": "tool", "name": self.name, "content": str(self.result)}


def _invoke(fn: Callable, arguments: dict) -> Any:
    out = fn(**arguments)
    return asyncio.run(out) if inspect.isawaitable(out) else out


def run_calls(rows: list[tuple[dict[str, Tool], list[ToolCall]]], pool: int, timeout_s: float) -> list[list[Outcome]]:
    """Each row's calls (its tools by name, its parsed calls) -> their outcomes in order. Rows run concurrently,
    at most `pool` calls at a time, a row's own calls one after another (an environment's state is sequential);
    a call past timeout_s is a failure (its thread, a daemon, is left to finish)."""
    outcomes: list[list[Outcome | None]] = [[None] * len(calls) for _, calls in rows]
    for k in range(max((len(calls) for _, calls in rows), default=0)):  # the k-th call of every row at once
        jobs = [(i, tools, calls[k]) for i, (tools, calls) in enumerate(rows) if k < len(calls)]
        for start in range(0, len(jobs), pool):
            batch = jobs[start:start + pool]
            threads = []
            for i, tools, call in batch:
                if call.error or call.name not in tools:
                    error = call.error or f"Tool {call.name} not found."
                    outcomes[i][k] = Outcome(call.name, {"error": error}, True)
                    continue
                box: list[Outcome] = []  # the thread's own: one that times out writes nowhere the caller reads

                def work(fn=tools[call.name].fn, call=call, box=box):
                    try:
                        box.append(Outcome(call.name, _invoke(fn, call.arguments), False))
                    except Exception as e:  # the user's tool: its error goes back to the model (TRL)
                        box.append(Outcome(call.name, {"error": str(e)}, True))
                thread = threading.Thread(target=work, daemon=True)
                thread.start()
                threads.append((i, call, thread, box))
            end = time.monotonic() + timeout_s
            for i, call, thread, box in threads:
                thread.join(max(0.0, end - time.monotonic()))
                outcomes[i][k] = box[0] if box else Outcome(call.name, {"error": f"timed out after {timeout_s:g} s"},
                                                            True)
    return outcomes
