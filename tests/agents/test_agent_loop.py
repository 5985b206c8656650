"""The multi-turn loop (llmtrain.rollout.agent) with a scripted engine, in process: token in, token out (a trajectory's
ids are the engine's sampled ids plus the tool messages as the chat template renders them), the tool_mask and
log-probs, several calls per turn and several turns, the budget's rollback, the failures fed back, environments."""

from __future__ import annotations

import json

import pytest
from helpers.agents import CALL, FORMAT, TOOLS, ScriptedEngine, script, stop_ids, tokenizer

from llmtrain.config import ConfigError
from llmtrain.rollout.agent import Agent, AgentError, Environments, ToolUse
from llmtrain.rollout.engine import Sampling
from llmtrain.rollout.tools import CallParser, as_tool, load_tools



@pytest.fixture
def tools(tmp_path):
    (tmp_path / "tools.py").write_text(TOOLS)
    return load_tools([f"{tmp_path / 'tools.py'}:{n}" for n in ("lookup", "add", "broken", "slow")])


def make_agent(style: str, timeout_s: float = 5.0, max_iterations: int | None = None):
    tok = tokenizer(style)
    stop = stop_ids(tok, style)
    agent = Agent(tok, CallParser(FORMAT[style], tok, stop), stop, tok.pad_token_id, max_iterations, timeout_s, 4,
                  __import__("torch").device("cpu"))
    return tok, stop[0], agent


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize("style", ["llama3", "chatml"])
def test_token_in_token_out(style, tools):
    """Trained ids = the engine's sampled ids + the tool messages' rendered tokens, nothing re-tokenized: the
    tool_mask's 1-runs are exactly the sampled turns (their log-probs the engine's), its 0-runs the suffixes, and
    prompt + trajectory decodes to the chat template's rendering of the whole conversation."""
    tok, stop, agent = make_agent(style)
    engine = ScriptedEngine(tok, stop, script(style))
    by_name = {t.name: t for t in tools}
    user = [[{"role": "user", "content": f"Question {i}?"}] for i in range(3)]
    prompts = [agent.prompt_ids(u, tools, 4096) for u in user]
    out = agent.run(engine, prompts, [(i, 0, 0, 0) for i in range(3)], Sampling(1000), [by_name] * 3)
    c = out.completions
    assert out.turns == [3, 1, 2] and out.calls == 5 and out.failures == 2
    for i in range(3):
        ids, mask, logps = c.tokens[i], c.tool_mask[i], c.logps[i]
        assert len(ids) == len(mask) == len(logps) and mask[0] == 1 and mask[-1] == 1
        runs, start = [], 0
        for j in range(1, len(ids) + 1):
            if j == len(ids) or mask[j] != mask[start]:
                runs.append((mask[start], ids[start:j], logps[start:j]))
                start = j
        sampled = [(r[1], r[2]) for r in runs if r[0] == 1]
        assert len(sampled) == out.turns[i]
        for t, (got, lp) in enumerate(sampled):  # each turn: the engine's ids and log-probs, as it returned them
            want = tok(script(style)[(i, t)], add_special_tokens=False)["input_ids"] + [stop]
            assert got == want and lp == [-(j + 1) / 100 for j in range(len(want))]
        tool_messages = [m for m in out.messages[i] if m["role"] == "tool"]
        suffixes = [r[1] for r in runs if r[0] == 0]
        assert all(r[2] == [0.0] * len(r[1]) for r in runs if r[0] == 0)
        if i == 0:  # the two results of the first turn rendered together, then the second turn's one
            assert suffixes == [agent.suffix_ids(tool_messages[:2]), agent.suffix_ids(tool_messages[2:])]
            assert [m["content"] for m in tool_messages] == ["42", "5", "7"]
        conversation = user[i] + out.messages[i]
        rendered = tok.apply_chat_template(conversation, tools=[t.schema for t in tools], tokenize=False)
        assert tok.decode(prompts[i] + ids) == rendered.removesuffix("\n")  # chatml: the final turn's newline
    # Token in: each later turn's prompt is the prompt + the trajectory so far, as ids.
    (first, *later) = engine.calls
    assert first[0] == prompts
    assert later[0][0][0] == prompts[0] + c.tokens[0][:len(later[0][0][0]) - len(prompts[0])]
    assert [k[4] for k in later[0][1]] == [1, 1]  # rows 0 and 2 sample their second turn keyed (..., 1)
    errors = [m["content"] for m in out.messages[2] if m["role"] == "tool"]
    assert errors == ["{'error': 'Tool nope not found.'}", "{'error': \"'k'\"}"]


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: the key
    """
    return "42"


@pytest.mark.usefixtures("single_process_group")
def test_budget_rolls_back_and_cuts():
    """A tool result that leaves no room to sample is rolled back (the trajectory ends at its call); a later turn is
    cut at what is left of grpo.max_completion_length and marked truncated."""
    tok, stop, agent = make_agent("llama3")
    call = CALL["llama3"]("lookup", {"key": "x"})
    engine = ScriptedEngine(tok, stop, {(0, 0): call, (0, 1): "word " * 50})
    prompt = agent.prompt_ids([{"role": "user", "content": "q"}], [], 64)
    first = len(tok(call, add_special_tokens=False)["input_ids"]) + 1
    suffix = len(agent.suffix_ids([{"role": "tool", "name": "lookup", "content": "42"}]))
    tools = {"lookup": as_tool(lookup, "test")}
    out = agent.run(engine, [prompt], [(0, 0, 0, 0)], Sampling(first + suffix + 5), [tools])
    c = out.completions
    assert len(c.tokens[0]) == first + suffix + 5 and c.truncated == [True] and out.turns == [2]
    assert c.tool_mask[0] == [1] * first + [0] * suffix + [1] * 5
    assert engine.calls[1][2] == 5  # the second round samples what is left
    out = agent.run(engine, [prompt], [(0, 0, 0, 0)], Sampling(first + suffix), [tools])  # no room after the result
    assert out.completions.tool_mask[0] == [1] * first and out.completions.truncated == [False]
    assert [m["role"] for m in out.messages[0]] == ["assistant"] and out.calls == 1 and out.turns == [1]


def test_parsers():
    """hermes and llama3_json read any number of calls; what cannot be read is a call that failed (fed back as an
    error), not a crash; auto is refused in one line for a tokenizer without a response template."""
    from llmtrain.rollout.tools import parse_hermes, parse_llama3_json

    got = parse_hermes('Let me see. <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
                       '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>')
    assert got.content == "Let me see." and [(c.name, c.arguments, c.error) for c in got.calls] == \
        [("a", {"x": 1}, None), ("b", {"y": 2}, None)]
    bad = parse_hermes('<tool_call>{"name": "a", </tool_call> <tool_call>{"name": "b"')
    assert [c.error is not None for c in bad.calls] == [True, True] and "not valid JSON" in bad.calls[0].error
    assert parse_hermes("just text").calls == []
    two = parse_llama3_json('{"name": "a", "parameters": {"s": "x; y"}}; {"name": "b", "parameters": {}}')
    assert [(c.name, c.arguments) for c in two.calls] == [("a", {"s": "x; y"}), ("b", {})]
    assert parse_llama3_json("The answer is 4.") == ("The answer is 4.", [])
    assert parse_llama3_json('{"nam": 1}').calls[0].error.startswith("a tool call must be a JSON object")
    tok = tokenizer("llama3")
    with pytest.raises(ConfigError, match=r"^grpo.tool_call_format: auto .* has none; choose one of hermes, "):
        CallParser("auto", tok, [0])


def test_tool_failures(tools):
    """A tool that raises, an unknown name, a call past grpo.tool_timeout_s: failures with {"error": ...}, the others
    run; an async tool is awaited; rows' calls run concurrently in the bounded pool, a row's own in order."""
    import time

    from llmtrain.rollout.tools import ToolCall, run_calls

    by_name = {t.name: t for t in tools}
    rows = [(by_name, [ToolCall("add", {"a": 1, "b": 2}), ToolCall("broken", {"key": "q"})]),
            (by_name, [ToolCall("slow", {"seconds": 5.0}), ToolCall("lookup", {"key": "y"})]),
            (by_name, [ToolCall("missing", {}), ToolCall("unknown", {}, "a tool call is not valid JSON")]),
            (by_name, [ToolCall("slow", {"seconds": 0.2})])]
    t0 = time.monotonic()
    out = run_calls(rows, 4, 0.5)
    assert time.monotonic() - t0 < 1.5  # the 5 s call was given up at 0.5 s; the 0.2 s one ran beside it
    assert [[(o.name, o.result, o.failed) for o in r] for r in out] == [
        [("add", 3, False), ("broken", {"error": "'q'"}, True)],
        [("slow", {"error": "timed out after 0.5 s"}, True), ("lookup", "7", False)],
        [("missing", {"error": "Tool missing not found."}, True),
         ("unknown", {"error": "a tool call is not valid JSON"}, True)],
        [("slow", "woke", False)]]
    assert out[0][1].message() == {"role": "tool", "name": "broken", "content": "{'error': \"'q'\"}"}  # TRL's str()


def test_bad_tools_refused(tmp_path):
    """A tools file that does not import, a function without type hints, two tools of one name: one line naming
    the key (a ConfigError: exit 2 at set-up, before any process group)."""
    (tmp_path / "tools.py").write_text(TOOLS)
    (tmp_path / "broken.py").write_text("import nothing_here\n")
    cases = {f"{tmp_path}/tools.py:untyped": r"^grpo.tools\[0\]: 'untyped' cannot be a tool: .*type hint",
             f"{tmp_path}/broken.py:f": r"^grpo.tools\[0\]: .*importing .*broken.py failed: ModuleNotFoundError"}
    for spec, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_tools([spec])
    with pytest.raises(ConfigError, match="two tools named 'lookup'"):
        load_tools([f"{tmp_path}/tools.py:lookup"] * 2)


ENV = '''
class Vault:
    """Holds a code per episode: only its tool tells it."""

    def reset(self, prompt, code, **row):
        self.code, self.opened = code, 0
        return " (vault ready)"

    def open_vault(self) -> str:
        """Open the vault and read its code."""
        self.opened += 1
        return self.code

    def get_reward(self):
        return float(self.opened)

    def _private(self):
        pass


class BadReset(Vault):
    def reset(self, prompt, **row):
        raise RuntimeError("no vault here")


class NaNReward(Vault):
    def get_reward(self):
        return float("nan")
'''


@pytest.mark.usefixtures("single_process_group")
def test_environments(tmp_path):
    """One instance per trajectory: reset(**row)'s text appended to the last user message, its public methods its
    tools (called on that instance), get_reward a reward function named by its class; reset raising stops in one
    line naming the class and the prompt index; get_reward returning NaN likewise (rewards' check)."""
    from llmtrain.rewards import RewardError, score

    (tmp_path / "env.py").write_text(ENV)
    tok, stop, agent = make_agent("llama3")
    envs = Environments(f"{tmp_path / 'env.py'}:Vault")
    use = ToolUse(agent, [], envs, 4096)
    engine = ScriptedEngine(tok, stop, {(0, 0): CALL["llama3"]("open_vault", {}), (0, 1): "It is 831.",
                                        (1, 0): "I guess 5."})
    user = [{"role": "user", "content": "The code?"}]
    ep = use.run(engine, [user, user], [{"code": "831"}, {"code": "112"}], [0, 1], [(0, 0, 0, 0), (1, 0, 0, 0)],
                 Sampling(1000))
    assert tok.decode(ep.prompt_ids[0]).endswith("The code? (vault ready)<|eot_id|><|start_header_id|>assistant"
                                                 "<|end_header_id|>\n\n")
    assert '"name": "open_vault"' in tok.decode(ep.prompt_ids[0]) and "_private" not in tok.decode(ep.prompt_ids[0])
    assert ep.trajectories.messages[0][1] == {"role": "tool", "name": "open_vault", "content": "831"}
    assert [e.opened for e in ep.environments] == [1, 0] and user[0]["content"] == "The code?"
    (reward,) = envs.reward_funcs()
    assert reward.name == "Vault" and score([reward], [user] * 2, [[], []], [[], []],
                                            {"environments": ep.environments}, [0, 1]) == [[1.0], [0.0]]
    with pytest.raises(AgentError, match=r"^BadReset.reset raised RuntimeError: no vault here \(prompt index 7\)$"):
        ToolUse(agent, [], Environments(f"{tmp_path / 'env.py'}:BadReset"), 64).run(
            engine, [user], [{"code": "1"}], [7], [(0, 0, 0, 0)], Sampling(10))
    nan = Environments(f"{tmp_path / 'env.py'}:NaNReward")
    ep = ToolUse(agent, [], nan, 4096).run(engine, [user], [{"code": "1"}], [3], [(1, 0, 0, 0)], Sampling(100))
    with pytest.raises(RewardError, match=r"^reward function NaNReward.get_reward returned nan for prompt index 3"):
        score(nan.reward_funcs(), [user], [[]], [[]], {"environments": ep.environments}, [3])


def test_bad_tool_keys_exit_2_before_start(tmp_path, run_setup):
    """recipes/grpo.py refuses, before any process group (exit 2, one line): a function without type hints as a
    tool, an environment file that does not exist, an environment with no get_reward and no grpo.reward_funcs."""
    from helpers.grpo import GRPO, write_config

    config = write_config(tmp_path)
    (tmp_path / "tools.py").write_text(TOOLS)
    (tmp_path / "env.py").write_text("class NoReward:\n    def reset(self, **row):\n        pass\n")
    cases = {(f"grpo.tools=[{tmp_path}/tools.py:untyped]",): "grpo.tools[0]: 'untyped' cannot be a tool: ",
             (f"grpo.environment={tmp_path}/none.py:Env",): f"grpo.environment: '{tmp_path}/none.py:Env': no file",
             (f"grpo.environment={tmp_path}/env.py:NoReward", "grpo.reward_funcs=[]"):
                 "grpo.reward_funcs: name at least one reward function"}
    for overrides, message in cases.items():
        code, _, err = run_setup(GRPO, "--config", config, f"output_dir={tmp_path / 'out'}", *overrides)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "out").exists()


@pytest.mark.usefixtures("single_process_group")
def test_several_environments_by_column(tmp_path):
    """grpo.environment as a mapping: each row's `environment` column picks its class (and so its tools, rendered
    into its prompt only); a name not in the mapping stops in one line naming it and the row."""
    (tmp_path / "env.py").write_text(ENV + '''
class Safe(Vault):
    def turn_dial(self, steps: int) -> str:
        """Turn the dial.

        Args:
            steps: how far
        """
        return "click"
''')
    tok, stop, agent = make_agent("llama3")
    envs = Environments({"vault": f"{tmp_path / 'env.py'}:Vault", "safe": f"{tmp_path / 'env.py'}:Safe"})
    assert sorted(f.name for f in envs.reward_funcs()) == ["Safe", "Vault"]
    use = ToolUse(agent, [], envs, 4096)
    engine = ScriptedEngine(tok, stop, {})
    user = [{"role": "user", "content": "Go."}]
    ep = use.run(engine, [user, user], [{"code": "1", "environment": "vault"}, {"code": "2", "environment": "safe"}],
                 [0, 1], [(0, 0, 0, 0), (1, 0, 0, 0)], Sampling(4))
    assert [type(e).__name__ for e in ep.environments] == ["Vault", "Safe"]
    assert ["turn_dial" in tok.decode(ids) for ids in ep.prompt_ids] == [False, True]
    with pytest.raises(AgentError, match=r"^grpo.environment: prompt index 5 has environment 'box'; choose one of "
                                         r"vault, safe$"):
        use.run(engine, [user], [{"code": "1", "environment": "box"}], [5], [(0, 0, 0, 0)], Sampling(4))


@pytest.mark.usefixtures("single_process_group")
def test_auto_reads_calls_with_the_tokenizers_response_template(tools):
    """grpo.tool_call_format=auto: the tokenizer's parse_response gets each turn's ids with what came before them
    (prompt and earlier turns, as ids) and the row's tools' schemas, as TRL calls it; its tool_calls are the calls."""
    tok, stop, _ = make_agent("llama3")
    seen = []

    def parse_response(ids, prefix, tools):
        seen.append((list(ids), list(prefix), [t["function"]["name"] for t in tools]))
        text = tok.decode(ids[:-1])
        calls = [{"type": "function", "function": json.loads(text.replace("parameters", "arguments"))}] \
            if text.startswith("{") else []
        return {"role": "assistant", "content": "" if calls else text, "tool_calls": calls}

    tok.response_template, tok.parse_response = {"stand-in": True}, parse_response
    agent = Agent(tok, CallParser("auto", tok, [stop]), [stop], tok.pad_token_id, None, 5.0, 2,
                  __import__("torch").device("cpu"))
    engine = ScriptedEngine(tok, stop, {(0, 0): CALL["llama3"]("lookup", {"key": "y"}), (0, 1): "Seven."})
    prompt = agent.prompt_ids([{"role": "user", "content": "y?"}], tools, 4096)
    out = agent.run(engine, [prompt], [(0, 0, 0, 0)], Sampling(1000), [{t.name: t for t in tools}])
    assert out.messages[0][1:] == [{"role": "tool", "name": "lookup", "content": "7"},
                                   {"role": "assistant", "content": "Seven."}]
    ids = out.completions.tokens[0]
    first = len(seen[0][0])
    assert seen[0][1] == prompt and seen[1][1] == prompt + ids[:len(ids) - len(seen[1][0])]
    assert seen[0][2] == ["lookup", "add", "broken", "slow"] and ids[:first] == seen[0][0]
