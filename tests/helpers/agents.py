"""What the tool-use tests (tests/agents/) share: the bundled tiny tokenizer with a tool-calling chat template (Llama-3
style with llama3_json calls, or ChatML / Qwen style with hermes calls, its <|im_start|> / <|im_end|> added as
special tokens), tools in a file, and ScriptedEngine: an Engine that "samples" scripted texts per row key and turn
(token in, token out is checked against what it returned)."""

from __future__ import annotations

import json
import time

from helpers import REPO

TEMPLATES = {"llama3": REPO / "configs" / "templates" / "llama3-tools.jinja",
             "chatml": REPO / "configs" / "templates" / "chatml-tools.jinja"}
FORMAT = {"llama3": "llama3_json", "chatml": "hermes"}
CALL = {"llama3": lambda name, args: json.dumps({"name": name, "parameters": args}),
        "chatml": lambda name, args: "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"}
JOIN = {"llama3": "; ", "chatml": "\n"}

TOOLS = '''\
import asyncio, time


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: the key to look up
    """
    return {"x": "42", "y": "7"}.get(key, "none")


async def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    await asyncio.sleep(0)
    return a + b


def broken(key: str) -> str:
    """Always fails.

    Args:
        key: anything
    """
    raise KeyError(key)


def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


def untyped(key):
    """No type hints.

    Args:
        key: anything
    """
    return key
'''


def tokenizer(style: str):
    """The bundled tokenizer with `style`'s tool-calling template (chatml: its markers added as special tokens,
    <|im_end|> its EOS)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(REPO / "assets" / "tokenizer")
    tok.chat_template = TEMPLATES[style].read_text()
    if style == "chatml":
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.eos_token = "<|im_end|>"
    return tok


def script(style: str) -> dict[tuple[int, int], str]:
    """Three rows' turns, by (row, turn): TOOLS' lookup and add called in one turn then lookup again and an answer;
    an answer at once; an unknown tool and the raising one, then an answer."""
    call, join = CALL[style], JOIN[style]
    return {(0, 0): join.join([call("lookup", {"key": "x"}), call("add", {"a": 2, "b": 3})]),  # two calls a turn
            (0, 1): call("lookup", {"key": "y"}),                                             # a second round
            (0, 2): "It is 42 and 7.",
            (1, 0): "No tool needed.",                                                        # answers at once
            (2, 0): join.join([call("nope", {}), call("broken", {"key": "k"})]),              # unknown, raises
            (2, 1): "Sorry."}


def stop_ids(tok, style: str) -> list[int]:
    return [tok.convert_tokens_to_ids("<|eot_id|>" if style == "llama3" else "<|im_end|>")]


class ScriptedEngine:
    """An Engine whose completion for key k at turn t (t = 0 for a key without a turn suffix) is the text
    script[(k[0], t)] tokenized, plus the stop id; its log-probs are -(position + 1) / 100 so that where each
    lands can be checked. It records every call's prompts and keys."""
    copies_weights, weights_dtype = False, None

    def __init__(self, tok, stop: int, script: dict[tuple[int, int], str]):
        self.tok, self.stop, self.script, self.calls = tok, stop, script, []

    def generate(self, prompt_ids, keys, sampling):
        from llmtrain.rollout.engine import Completions

        self.calls.append((prompt_ids, keys, sampling.max_tokens))
        tokens, cut, logps = [], [], []
        for key in keys:
            text = self.script.get((key[0], key[4] if len(key) > 4 else 0), "")
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.stop]
            ids = ids[:sampling.max_tokens]
            tokens.append(ids)
            cut.append(ids[-1] != self.stop)
            logps.append([-(j + 1) / 100 for j in range(len(ids))])
        time.sleep(0)
        return Completions(tokens, cut, logps, 0.0)

    def update_weights(self, step, full):
        pass


SFT_CONFIG = """\
model:
  config: {hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4,
           num_key_value_heads: 2, max_position_embeddings: 512, tie_word_embeddings: true}
tokenizer: {path: assets/tokenizer}
data: {path: data/demo/agent/sft.jsonl, format: chat, chat_template: configs/templates/llama3-tools.jinja,
       seq_len: 384}
parallel: {strategy: none}
train: {max_steps: 60, micro_batch_size: 8, grad_accum_steps: 1, lr: 1.0e-2, warmup_steps: 4, seed: 3,
        lr_schedule: constant}
log: {every_steps: 10, progress: false}
"""

GRPO_CONFIG = """\
model: {path: SFT}
data: {path: data/demo/agent/prompts.jsonl, format: prompt, chat_template: configs/templates/llama3-tools.jinja,
       seq_len: 320}
parallel: {strategy: none}
train: {max_steps: 4, micro_batch_size: 4, grad_accum_steps: 2, lr: 1.0e-3, warmup_steps: 1, seed: 7,
        lr_schedule: constant}
grpo: {num_generations: 4, max_completion_length: 72, num_iterations: 2, beta: 0.0, temperature: 1.2,
       environment: data/demo/agent/vault.py:Vault, tool_call_format: llama3_json,
       reward_funcs: [llmtrain.rewards:exact_answer, REWARDS:digits]}
log: {every_steps: 1, progress: false, completions_every_steps: 1}
"""
REWARDS = """\
def digits(prompts, completions, completion_ids, answer, **kw):
    # the code's digits the final message has in place, and its length: a reward that differs within every group
    return [(sum(a == b for a, b in zip(c[-1]["content"].strip(), code)) + len(c[-1]["content"]) / 10) / 3
            for c, code in zip(completions, answer)]
"""
FLAKY_VAULT = """\
import math


class FlakyVault:
    # data/demo/agent/vault.py's tool, and a get_reward that turns NaN from the process's 9th episode on
    episodes = 0

    def reset(self, prompt, answer, **row):
        FlakyVault.episodes += 1
        self.code, self.episode = answer, FlakyVault.episodes

    def read_code(self) -> str:
        \"\"\"Read the vault's code.\"\"\"
        return self.code

    def get_reward(self):
        return math.nan if self.episode > 8 else 0.0
"""
