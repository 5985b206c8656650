"""Reward functions for GRPO: loaded from grpo.reward_funcs at set-up, called as TRL's GRPOTrainer calls them.

A reward function is named "package.module:function" or "path/to/file.py:function" (a path relative to
the working directory) and called once per step on this rank's completions:

    f(prompts, completions, completion_ids, **columns) -> list[float | None]

prompts and completions are text, or for chat prompts (lists of messages) the prompt's messages and
[{"role": "assistant", "content": text}]; completion_ids the sampled token ids (EOS included); columns every
other column of the records (e.g. answer), one value per completion. None means "not applicable": left out
of that function's statistics and of the weighted sum (TRL's nansum).

An entry that names a directory (a spec without ':', or an existing directory) is a reward model, as TRL's
GRPOTrainer takes a model there: a Hugging Face sequence classifier with one label (recipes/reward.py's export),
scored on prompt + completion with its own tokenizer and chat template by the recipe (rollout.scoring.ModelReward),
under the policy's strategy; its name is the directory's (TRL's: the last part of the model's path).

Built-ins, no user code needed:
  llmtrain.rewards:exact_answer  1.0 when the completion's answer equals the record's `answer` column after
                                 normalisation (see normalize), else 0.0; None for records without one
  llmtrain.rewards:format_regex  1.0 when the completion matches the record's `format` column (a regex),
                                 or FORMAT (a final answer as "#### <answer>") without one, else 0.0
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import math
import re
import signal
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any, NamedTuple

from transformers import AutoConfig

from llmtrain import distributed
from llmtrain.config import ConfigError, RunError
from llmtrain.models import hf

FORMAT = r"(?s).*####\s*\S+\s*$"
FLOAT32_MAX = 3.4028234663852886e38  # the advantages take rewards in float32: beyond it a reward is inf
ANSWER = re.compile(r"####\s*(.+?)\s*$", re.S)


class RewardError(RunError):
    """A reward function failed or answered wrongly during training; the message is one line. collective: every
    rank raises it alike (cli.report prints rank 0's)."""

    def __init__(self, message: str, collective: bool = False):
        super().__init__(message)
        self.collective = collective


class RewardFunc(NamedTuple):
    spec: str            # as written in grpo.reward_funcs
    name: str            # the function's __name__ (a reward model's directory name): the metric key rewards/<name>/...
    fn: Callable | None  # None: a reward model, scored by the recipe's rollout.scoring.ModelReward


def is_model(spec: str) -> bool:
    """A reward-model directory rather than a function: an existing directory, or a spec without ':'."""
    return Path(spec).is_dir() or ":" not in spec


def file_of(spec: str) -> str | None:
    """The file or directory a spec reads: a 'path/to/file.py:function''s file, a reward model's directory (None
    for 'package.module:function')."""
    if is_model(spec):
        return spec
    where = spec.rpartition(":")[0]
    return where if where.endswith(".py") else None


def check_model(path: str, key: str, trust_remote_code: bool = False) -> None:
    """A reward-model directory: a Hugging Face sequence classifier with one label whose weights hold its score
    head, not quantized, with its own tokenizer; a ConfigError naming the key otherwise (a causal LM included: it
    has no score head)."""
    if not Path(path).is_dir():
        raise ConfigError(f"{key}: {path!r} is not 'package.module:function', 'path/to/file.py:function' or a "
                          "reward-model directory (no such directory)")
    config = Path(path) / "config.json"
    if not config.is_file():
        raise ConfigError(f"{key}: {path} has no config.json (not a Hugging Face model directory)")
    archs = json.loads(config.read_text()).get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        what = "a causal LM" if any(hf.CAUSAL_LM_CLASS.search(a) for a in archs) else "not a sequence classifier"
        raise ConfigError(f"{key}: {path} is a {', '.join(archs) or 'model without architectures'} (config.json), "
                          f"{what} with no score head; a reward model is a sequence classifier with one label "
                          "(AutoModelForSequenceClassification): train one with recipes/reward.py")
    labels = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).num_labels
    if labels != 1:
        raise ConfigError(f"{key}: {path} has {labels} labels (config.json id2label); a reward model gives one "
                          "score per completion (num_labels 1)")
    try:
        hf.check_not_quantized(path)
        hf.check_weights(Path(path))
    except ConfigError as e:
        raise ConfigError(str(e).replace("model.path", key, 1)) from None
    if not hf.has_score_head(path):
        raise ConfigError(f"{key}: {path}'s weights have no {hf.SCORE_HEAD}: its score head would be untrained")
    hf.load_tokenizer(path, trust_remote_code, key,
                      "a reward model's directory holds its tokenizer (recipes/reward.py's export does)")


def load(spec: str, key: str = "grpo.reward_funcs", trust_remote_code: bool = False) -> RewardFunc:
    """'package.module:function' or 'path/to/file.py:function' -> the callable, a reward-model directory
    checked (check_model); a ConfigError naming the key and what is missing otherwise."""
    if is_model(spec):
        check_model(spec, key, trust_remote_code)
        return RewardFunc(spec, Path(spec).name, None)
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ConfigError(f"{key}: {spec!r} is not 'package.module:function' or 'path/to/file.py:function'")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ConfigError(f"{key}: {spec!r}: no file {where}")
        name = f"llmtrain_reward_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:  # the user's file: any error in it is a set-up error naming it
            raise ConfigError(f"{key}: {spec!r}: importing {where} failed: {type(e).__name__}: {e}") from None
        sys.modules[name] = module
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise ConfigError(f"{key}: {spec!r}: no module named {e.name!r}") from None
        except Exception as e:  # an error inside the user's module
            raise ConfigError(f"{key}: {spec!r}: importing {where} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{key}: {spec!r}: {where} has no function {attr!r}" if not hasattr(module, attr) else
                          f"{key}: {spec!r}: {attr!r} in {where} is a {type(fn).__name__}, not callable")
    return RewardFunc(spec, getattr(fn, "__name__", attr), fn)


def load_all(specs: list[str], key: str = "grpo.reward_funcs", trust_remote_code: bool = False) -> list[RewardFunc]:
    """Every function (and reward model) of grpo.reward_funcs, at set-up (before any process group); names must be
    unique (they key the metrics)."""
    funcs = [load(spec, f"{key}[{i}]", trust_remote_code) for i, spec in enumerate(specs)]
    names = [f.name for f in funcs]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"{key}: two functions named {name!r}; their metrics rewards/{name}/* would collide "
                              "(a reward model is named by its directory)")
    return funcs


def reward_timeout(reward_timeout_s: float | None, collective_timeout_s: float) -> float:
    """grpo.reward_timeout_s as it applies (None: half of distributed.timeout_s); a ConfigError when it is not
    below distributed.timeout_s, the time the other ranks wait for this one's rewards in a collective."""
    if reward_timeout_s is None:
        return collective_timeout_s / 2
    if reward_timeout_s >= collective_timeout_s:
        raise ConfigError(f"grpo.reward_timeout_s={reward_timeout_s:g} must be below distributed.timeout_s="
                          f"{collective_timeout_s:g}: the other ranks wait that long for a rank's rewards, and would "
                          "fail without naming the function; lower it or raise distributed.timeout_s")
    return reward_timeout_s


class RewardTimeout(BaseException):
    """Raised inside a reward function when grpo.reward_timeout_s is up (a BaseException: the function's own
    `except Exception` does not swallow it)."""


@contextlib.contextmanager
def deadline(seconds: float | None):
    """Interrupt the block after `seconds` (None: never) with RewardTimeout: a SIGALRM timer, so that a sleep, a
    blocking read or a Python loop is interrupted in the main thread, where the function keeps its signals (a
    library such as math_verify arms its own alarm: that replaces ours for its call). A function stuck in C code
    that holds the GIL is not interrupted: distributed.timeout_s still ends the run."""
    if seconds is None:
        yield
        return
    if seconds <= 0:
        raise RewardTimeout

    def expired(signum, frame):
        raise RewardTimeout

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def score(funcs: list[RewardFunc], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], prompt_index: list[int], timeout_s: float | None = None,
          rank: int = 0, scored: dict[int, list[float]] | None = None) -> list[list[float]]:
    """[completion][function] rewards (NaN for None). prompt_index: each completion's prompt index in the
    dataset, to name in errors; scored: the reward models' rewards, by their index in funcs (computed beforehand,
    rollout.scoring.ModelReward). A function that raises, returns the wrong number of rewards, a value that is
    not a number or a non-finite one, or takes longer than timeout_s seconds (grpo.reward_timeout_s, the call
    and the search for the prompt it fails on together) stops with a one-line RewardError naming the function
    and the prompt index (or, for the timeout, the rank); a reward model's non-finite score too."""
    out = [[math.nan] * len(funcs) for _ in completions]
    for j, f in enumerate(funcs):
        values = scored[j] if f.fn is None else call(f, prompts, completions, completion_ids, columns, prompt_index,
                                                     timeout_s, rank)
        n = len(values) if isinstance(values, (list, tuple)) else None
        if n != len(completions):
            got = f"{n} rewards" if n is not None else f"a {type(values).__name__}, not a list,"
            raise RewardError(f"reward function {f.spec} returned {got} for {len(completions)} completions "
                              f"(prompts {_indices(prompt_index)}); it must return one reward per completion")
        for i, v in enumerate(values):
            if v is None:
                continue
            try:
                out[i][j] = float(v)
            except (TypeError, ValueError, OverflowError):
                raise RewardError(f"reward function {f.spec} returned {v!r} for prompt index {prompt_index[i]}; "
                                  "expected a number or None") from None
            if not abs(out[i][j]) <= FLOAT32_MAX:  # NaN, inf, 1e300: the advantages would be NaN or 0
                raise RewardError(f"reward function {f.spec} returned {v!r} for prompt index {prompt_index[i]}; a "
                                  f"reward must be a finite number within float32's range (|r| <= {FLOAT32_MAX:.4g}), "
                                  "or None for not applicable")
    return out


def call(f: RewardFunc, prompts: list, completions: list, completion_ids: list[list[int]], columns: dict[str, list],
         prompt_index: list[int], timeout_s: float | None, rank: int) -> Any:
    """What the function f returns for the completions, within timeout_s (score()'s RewardErrors otherwise)."""
    end = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        with deadline(timeout_s):
            return f.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    except RewardTimeout:
        raise RewardError(f"reward function {f.spec} did not return within grpo.reward_timeout_s={timeout_s:g} s "
                          f"on rank {rank} (prompts {_indices(prompt_index)})") from None
    except Exception as e:  # the user's code: find the prompt it fails on, and say so in one line
        i = _first_failing(f, prompts, completions, completion_ids, columns, end)
        where = f"prompt index {prompt_index[i]}" if i is not None else f"prompts {_indices(prompt_index)}"
        raise RewardError(f"reward function {f.spec} raised {type(e).__name__}: {one_line(e)} ({where})") from e


def score_everywhere(funcs: list[RewardFunc], prompts: list, completions: list, completion_ids: list[list[int]],
                     columns: dict[str, list], prompt_index: list[int], timeout_s: float | None,
                     rank: int, scored: dict[int, list[float]] | None = None) -> list[list[float]]:
    """score() on this rank's completions (scored: the reward models', as score() takes them), then every rank
    learns whether any failed (a collective: every rank calls it): a failure anywhere stops every rank with the
    failing rank's line (RewardError, exit 1; printed once), before anything of the step is saved. A hung function
    ends at timeout_s, below distributed.timeout_s, so that the waiting ranks hear which function and rank it was
    instead of a collective's timeout."""
    error, per_func = None, None
    try:
        per_func = score(funcs, prompts, completions, completion_ids, columns, prompt_index, timeout_s, rank, scored)
    except RewardError as e:
        error = str(e)
    if failed := next((e for e in distributed.gather_objects(error) if e), None):
        raise RewardError(failed, collective=True)
    return per_func


def none_applied(scores, funcs: list[RewardFunc], prompt_index: list[int], step: int) -> str | None:
    """A line for the log when every function returned None for every completion of the step (every rank's
    [completions, functions] scores, NaN for None): its advantages are all 0. None otherwise."""
    if not bool(scores.isnan().all()):
        return None
    return (f"step {step}: every reward function ({', '.join(f.spec for f in funcs)}) returned None (not "
            f"applicable) for all {len(scores)} completions (prompts {_indices(prompt_index)}): no reward, so every "
            "advantage is 0 and only the KL term (grpo.beta) trains")


def _first_failing(f: RewardFunc, prompts, completions, completion_ids, columns, end: float | None) -> int | None:
    """The first completion that f raises on when called on it alone (None: it fails on none alone, or the
    time until `end`, time.monotonic()'s, is up)."""
    for i in range(len(completions)):
        try:
            with deadline(None if end is None else end - time.monotonic()):
                f.fn(prompts=prompts[i:i + 1], completions=completions[i:i + 1],
                     completion_ids=completion_ids[i:i + 1], **{k: v[i:i + 1] for k, v in columns.items()})
        except RewardTimeout:
            return None
        except Exception:  # noqa: BLE001  (the user's code; only which one fails matters here)
            return i
    return None


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _indices(index: list[int]) -> str:
    unique = sorted(set(index))
    return ", ".join(map(str, unique[:8])) + (", ..." if len(unique) > 8 else "")


def completion_text(completion: Any) -> str:
    """The text of a completion as reward functions get it: a string, or [{"role": "assistant", "content"}]."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def normalize(text: str) -> str:
    """For exact_answer: the text after the last '####' when there is one, lower-cased, without surrounding
    whitespace, commas inside numbers, a trailing period or a leading '$'; numbers compared as numbers
    ('3.0' == '3')."""
    found = ANSWER.search(text)
    text = (found.group(1) if found else text).strip().lower().rstrip(".").lstrip("$").strip()
    text = re.sub(r"(?<=\d),(?=\d{3})", "", text)
    try:
        number = float(text)
    except ValueError:
        return " ".join(text.split())
    return str(int(number)) if number.is_integer() else repr(number)


def exact_answer(prompts, completions, completion_ids, answer=None, **columns) -> list[float | None]:
    """1.0 when normalize(completion) == normalize(answer), else 0.0; None without an answer column/value."""
    if answer is None:
        return [None] * len(completions)
    return [None if a is None else float(normalize(completion_text(c)) == normalize(str(a)))
            for c, a in zip(completions, answer)]


def format_regex(prompts, completions, completion_ids, format=None, **columns) -> list[float]:
    """1.0 when the whole completion matches the record's `format` regex (FORMAT without one), else 0.0."""
    patterns = format if format is not None else [None] * len(completions)
    return [float(re.fullmatch(p or FORMAT, completion_text(c)) is not None) for c, p in zip(completions, patterns)]
