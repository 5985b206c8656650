"""Multi-turn tool-use rollouts (TRL 1.16's GRPOTrainer tools= / environment_factory=) on the rollout seam:
sample -> parse the turn's tool calls -> run them -> append the tool messages' tokens -> sample again, up to
grpo.max_tool_calling_iterations times, within grpo.max_completion_length for the whole trajectory.

Token in, token out: a trajectory's ids are exactly the ids the engine sampled plus the tokens of the tool
messages as the chat template renders them between two turns (TRL's _get_tool_suffix_ids: a dummy assistant turn
with a call, cut after its end-of-turn token, then the tool messages and the next generation prompt); the model's
own text is never re-tokenized. Its tool_mask (1: the model's tokens, 0: the tool messages') keeps the tool
tokens out of the loss, the length metrics and the drift guard; the engine's log-probs cover the model's tokens.
A tool result that would leave no room to sample in the budget is rolled back and the trajectory ends there (TRL).

Each turn t >= 1 samples with the row's key + (t,), so with the local engine a trajectory depends on its key, its
prompt, the tools and the weights only: the same at any world size, strategy and split. Every rank runs as many
turns (one all-reduce decides each), a rank with no row left feeding one padding row (the local engine's generate
is collective).

Environments (grpo.environment): one instance per trajectory; reset(**row) may return text appended to the last
user message; its public methods are its tools; its get_reward() is a reward function named by its class."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch
from jinja2 import TemplateError
from torch.distributed import ReduceOp

from llmtrain import distributed
from llmtrain.config import ConfigError, RunError
from llmtrain.rewards import RewardFunc, load
from llmtrain.rollout.engine import Completions, Engine, Sampling
from llmtrain.rollout.tools import CallParser, Parsed, Tool, methods, run_calls, unique


class AgentError(RunError):
    """An environment failed (reset raised): one line naming its class and the data row; collective: every rank
    raises it alike."""

    def __init__(self, message: str):
        super().__init__(message)
        self.collective = True


class Trajectories(NamedTuple):
    completions: Completions        # the whole trajectories (tokens, engine log-probs, truncation, tool_mask)
    messages: list[list[dict]]      # each one's messages after its prompt: assistant turns, tool results
    calls: int                      # tool calls made on this rank
    failures: int                   # of them, failed
    turns: list[int]                # sampled turns per trajectory


def assistant_message(parsed: Parsed) -> dict:
    message = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = [c.message() for c in parsed.calls]
    return message


class Agent:
    """The loop's fixed parts: the tokenizer (its chat template renders prompts and tool messages), the call
    parser, the stop ids (a turn ends at one), grpo.max_tool_calling_iterations (None: no limit but the budget),
    grpo.tool_timeout_s and the pool of concurrent calls."""

    def __init__(self, tokenizer, parser: CallParser, stop_ids: list[int], pad_id: int, max_iterations: int | None,
                 timeout_s: float, pool: int, device: torch.device):
        self.tokenizer, self.parse, self.stop, self.pad = tokenizer, parser, set(stop_ids), pad_id
        self.max_iterations, self.timeout_s, self.pool, self.device = max_iterations, timeout_s, pool, device

    def prompt_ids(self, messages: list[dict], tools: list[Tool], seq_len: int) -> list[int]:
        """A prompt rendered with its tools' schemas (tools=) and the generation prompt; its last seq_len tokens
        (as data.format prompt keeps them)."""
        ids = self.tokenizer.apply_chat_template(messages, tools=[t.schema for t in tools] or None, tokenize=True,
                                                 add_generation_prompt=True, return_dict=True)["input_ids"]
        return list(ids)[-seq_len:]

    def suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """The tokens between a turn's end-of-turn token and the next turn: the tool messages and the next
        generation prompt, as the chat template renders them (TRL's _get_tool_suffix_ids)."""
        call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        render = lambda m, gen: list(self.tokenizer.apply_chat_template(  # noqa: E731
            m, add_generation_prompt=gen, tokenize=True, return_dict=True)["input_ids"])
        try:
            prefix, full = render(dummy, False), render(dummy + tool_messages, True)
        except TemplateError as e:
            raise RunError(f"the chat template cannot render a tool message: {e}; give one that supports tools "
                           "(data.chat_template, e.g. configs/templates/llama3-tools.jinja)") from None
        ends = [i for i, t in enumerate(prefix) if t in self.stop]
        prefix = prefix[:ends[-1] + 1] if ends else prefix
        if full[:len(prefix)] != prefix:
            raise RunError("the chat template renders an assistant turn differently once tool messages follow it; "
                           "the tool messages' tokens cannot be appended to the sampled ones")
        return full[len(prefix):]

    def run(self, engine: Engine, prompt_ids: list[list[int]], keys: list[tuple[int, ...]], sampling: Sampling,
            tools: list[dict[str, Tool]]) -> Trajectories:
        """Collective (every rank, each with its rows). tools: each row's tools by name."""
        out = engine.generate(prompt_ids, keys, sampling)
        n, budget, seconds = len(prompt_ids), sampling.max_tokens, out.seconds
        ids, logps = [list(t) for t in out.tokens], [list(x) for x in out.logps]
        mask, truncated, turns = [[1] * len(t) for t in ids], list(out.truncated), [1] * n
        schemas = [[t.schema for t in row.values()] for row in tools]
        parsed = [self.parse(t, p, s) for t, p, s in zip(ids, prompt_ids, schemas)]
        messages = [[assistant_message(p)] for p in parsed]
        calls = failures = 0
        pending = [i for i in range(n) if parsed[i].calls and not truncated[i]]
        rounds = budget if self.max_iterations is None else self.max_iterations  # a round samples >= 1 token
        for turn in range(1, rounds + 1):
            if not self._any(len(pending)):
                break
            outcomes = run_calls([(tools[i], parsed[i].calls) for i in pending], self.pool, self.timeout_s)
            rows = []
            for i, done in zip(pending, outcomes):
                calls, failures = calls + len(done), failures + sum(o.failed for o in done)
                results = [o.message() for o in done]
                suffix = self.suffix_ids(results)
                if len(ids[i]) + len(suffix) >= budget:
                    continue  # rolled back: no room left to sample after it (TRL drops such a result)
                messages[i] += results
                ids[i] += suffix
                mask[i] += [0] * len(suffix)
                logps[i] += [0.0] * len(suffix)
                rows.append(i)
            width = int(self._max(max((budget - len(ids[i]) for i in rows), default=0)))
            if width == 0:
                break
            step = dataclasses.replace(sampling, max_tokens=width)  # one call for every row, each cut at its room
            got = engine.generate([prompt_ids[i] + ids[i] for i in rows] or [[self.pad]],
                                  [(*keys[i], turn) for i in rows] or [(0,)], step)
            seconds += got.seconds
            for j, i in enumerate(rows):
                room, before = budget - len(ids[i]), prompt_ids[i] + ids[i]
                tokens, cut = got.tokens[j][:room], got.truncated[j] or len(got.tokens[j]) > room
                ids[i] += tokens
                mask[i] += [1] * len(tokens)
                logps[i] += got.logps[j][:room]
                truncated[i], turns[i] = cut, turns[i] + 1
                parsed[i] = Parsed(self.tokenizer.decode(tokens, skip_special_tokens=True), []) if cut else \
                    self.parse(tokens, before, schemas[i])
                messages[i].append(assistant_message(parsed[i]))
            pending = [i for i in rows if parsed[i].calls and not truncated[i]]
        return Trajectories(Completions(ids, truncated, logps, seconds, mask), messages, calls, failures, turns)

    def _any(self, count: int) -> bool:
        return bool(self._max(count))

    def _max(self, value: int) -> float:
        return distributed.all_reduce(torch.tensor(float(value), device=self.device), ReduceOp.MAX).item()


# -- environments --------------------------------------------------------------------------------------------------

class Environments:
    """grpo.environment: one factory ("path.py:Factory"), or several by name with an `environment` column choosing
    one per row (TRL's multi-environment rule). Probed at set-up: each is built once, its tools' schemas made."""

    def __init__(self, spec: str | dict | None, key: str = "grpo.environment"):
        specs = {} if spec is None else {None: spec} if isinstance(spec, str) else dict(spec)
        self.factories: dict[str | None, Callable] = {}
        for name, s in specs.items():
            where = key if name is None else f"{key}.{name}"
            if not isinstance(s, str):
                raise ConfigError(f"{where}: expected 'path/to/file.py:Factory', got {s!r}")
            factory = load(s, where).fn
            try:
                probe = factory()
            except Exception as e:
                raise ConfigError(f"{where}: {s} could not be built: {type(e).__name__}: {e}") from None
            if not callable(getattr(probe, "reset", None)):
                raise ConfigError(f"{where}: {type(probe).__name__} has no reset method")
            unique(methods(probe, where), where)
            self.factories[name] = factory
        self.multi = isinstance(spec, dict)

    def __bool__(self) -> bool:
        return bool(self.factories)

    def reward_funcs(self) -> list[RewardFunc]:
        """Each environment class's get_reward, as a reward function over the `environments` column (TRL's)."""
        out = []
        for factory in self.factories.values():
            cls = type(factory()) if not isinstance(factory, type) else factory
            if callable(getattr(cls, "get_reward", None)):
                out.append(RewardFunc(f"{cls.__name__}.get_reward", cls.__name__, _get_reward(cls)))
        return out

    def start(self, prompts: list, columns: list[dict], prompt_index: list[int]) -> tuple[list, list, list]:
        """One instance per trajectory, reset with its row (its prompt and columns) -> (instances, prompts with
        what reset returned appended to the last user message, tools by name). Collective: a reset that raises
        anywhere stops every rank with one line naming the class and the row."""
        envs, out, error = [], [], None
        for prompt, cols, index in zip(prompts, columns, prompt_index):
            name = cols.get("environment") if self.multi else None
            factory = self.factories.get(name)
            if factory is None and error is None:
                error = (f"grpo.environment: prompt index {index} has environment {name!r}; choose one of "
                         f"{', '.join(map(str, self.factories))}")
            env = factory() if factory is not None else None
            prompt = copy.deepcopy(prompt)
            try:
                observation = env.reset(prompt=prompt, **{k: v for k, v in cols.items() if k != "environment"}) \
                    if env is not None else None
            except Exception as e:  # the user's environment: name it and the row
                error = error or f"{type(env).__name__}.reset raised {type(e).__name__}: {e} (prompt index {index})"
                observation = None
            if isinstance(observation, str) and isinstance(prompt, list):
                last = max(i for i, m in enumerate(prompt) if m["role"] == "user")
                prompt[last] = {**prompt[last], "content": prompt[last]["content"] + observation}
            envs.append(env)
            out.append(prompt)
        if failed := next((e for e in distributed.gather_objects(error) if e), None):
            raise AgentError(failed)
        return envs, out, [{t.name: t for t in methods(e, "grpo.environment")} if e else {} for e in envs]


def _get_reward(cls: type) -> Callable:
    def get_reward(environments, **kwargs):
        return [e.get_reward() if type(e) is cls else None for e in environments]
    return get_reward


class Episode(NamedTuple):
    prompt_ids: list[list[int]]     # each row's prompt as rendered with its tools (and its environment's reset)
    trajectories: Trajectories
    environments: list | None       # each row's environment instance (None: no grpo.environment)


class ToolUse:
    """grpo.tools and grpo.environment in a run: the Agent, the standalone tools (every row gets them) and the
    environments (each row's own tools beside them)."""

    def __init__(self, agent: Agent, tools: list[Tool], environments: Environments, seq_len: int):
        self.agent, self.tools, self.environments, self.seq_len = agent, tools, environments, seq_len

    @staticmethod
    def check_prompts(prompts: list, prompt_index: list[int]) -> None:
        """The step's prompts (every rank's, so every rank stops alike) are chats: text has no place for tools."""
        for prompt, index in zip(prompts, prompt_index):
            if not isinstance(prompt, list):
                raise AgentError(f"grpo.tools: prompt index {index} is text; tool use needs chat prompts, "
                                 '{"prompt": [{"role": "user", "content": ...}]} (rendered with the tools\' schemas)')

    def run(self, engine: Engine, prompts: list, columns: list[dict], prompt_index: list[int],
            keys: list[tuple[int, ...]], sampling: Sampling) -> Episode:
        """Collective: this rank's rows (their prompts as written, columns, prompt indices, keys)."""
        envs, own = None, [{} for _ in prompts]
        if self.environments:
            envs, prompts, own = self.environments.start(prompts, columns, prompt_index)
        toolsets = [{**{t.name: t for t in self.tools}, **mine} for mine in own]
        ids = [self.agent.prompt_ids(p, list(tools.values()), self.seq_len) for p, tools in zip(prompts, toolsets)]
        return Episode(ids, self.agent.run(engine, ids, keys, sampling, toolsets), envs)
