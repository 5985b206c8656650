"""The multi-turn loop (llmtrain.rollout.agent) on rollout.engine=vllm, in process: colocated (VLLMEngine on a fake
`vllm` module) and against a server (VLLMServerEngine on tests/helpers/vllm.py's FakeServer over real HTTP), each
answering a request with the scripted turn of its seed (the trajectory's key + (turn,)), with two tokens past the
stop id as a server may send. Each round is one request per trajectory still calling: its token-id prompt is the
prompt + the trajectory so far, its max_tokens what is left of the budget. The trained ids are the engine's ids up to
the stop id plus the tool messages' rendered tokens (token in, token out), the engine's log-probs on the model's
tokens, 0 and tool_mask 0 on the tool's. A real vLLM on a GPU: bench/gpu/engines.py."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch
from helpers.agents import FORMAT, TOOLS, script, stop_ids, tokenizer
from helpers.procs import free_port
from helpers.vllm import FakeServer, GlooTransport, trainer

from llmtrain.rollout.agent import Agent
from llmtrain.rollout.engine import EngineSetup
from llmtrain.rollout.local import Sampling, sample_seed
from llmtrain.rollout.section import RolloutSection
from llmtrain.rollout.tools import CallParser, load_tools

CPU = torch.device("cpu")
BUDGET = 400
JUNK = 2  # tokens an answer carries past its stop id


class Scripted:
    """The scripted turns by request seed: the turn's token ids, its stop id, JUNK more; log-prob -(i + 1) / 100."""

    def __init__(self, tok, stop: int, turns: dict[tuple[int, int], str]):
        self.tok, self.stop, self.by_seed = tok, stop, {}
        for (row, turn), text in turns.items():
            key = (row, 0, 0, 0) + ((turn,) if turn else ())
            self.by_seed[sample_seed(*key)] = tok(text, add_special_tokens=False)["input_ids"] + [stop]

    def answer(self, seed: int, max_tokens: int) -> tuple[list[int], list[float]]:
        ids = (self.by_seed[seed] + [self.stop - 1] * JUNK)[:max_tokens]
        return ids, [-(i + 1) / 100 for i in range(len(ids))]


def colocated(scripted: Scripted, monkeypatch, tmp_path) -> tuple:
    """A VLLMEngine whose vllm.LLM answers from `scripted`, and its requests as (prompt ids, seed, max_tokens)."""
    from llmtrain.rollout.vllm import VLLMEngine

    requests = []

    class LLM:
        def __init__(self, **kwargs):
            pass

        def generate(self, prompts, params, use_tqdm):
            requests.extend((p["prompt_token_ids"], s.seed, s.max_tokens) for p, s in zip(prompts, params))
            outputs = []
            for p in params:
                ids, logps = scripted.answer(p.seed, p.max_tokens)
                logprobs = [{t: SimpleNamespace(logprob=x, rank=1)} for t, x in zip(ids, logps)]
                outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=logprobs)]))
            return outputs

    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = LLM, lambda **kwargs: SimpleNamespace(**kwargs)
    monkeypatch.setitem(sys.modules, "vllm", module)
    model = trainer()
    setup = EngineSetup(model, model.config, None, [scripted.stop], 0, CPU, 1024, 3, 7, torch.bfloat16, str(tmp_path))
    return VLLMEngine(RolloutSection(vllm_gpu_memory_utilization=0.25), setup), lambda: requests


class ScriptedServer(FakeServer):
    """FakeServer whose /v1/completions answers from `scripted`."""

    def __init__(self, config, scripted: Scripted):
        super().__init__(config)
        self.scripted = scripted

    def route(self, route: str, body: dict | None):
        if route != "/v1/completions":
            return super().route(route, body)
        ids, logps = self.scripted.answer(body["seed"], body["max_tokens"])
        return {"choices": [{"index": 0, "token_ids": ids, "finish_reason": "stop",
                             "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": logps}}]}


def served(scripted: Scripted, servers: list) -> tuple:
    """A VLLMServerEngine on a ScriptedServer (closed by the test's fixture), and its requests as in colocated."""
    from llmtrain.rollout.vllm_server import VLLMServerEngine

    model = trainer()
    fake = ScriptedServer(model.config, scripted)
    servers.append(fake)
    setup = EngineSetup(model, model.config, None, [scripted.stop], 0, CPU, 1024, 3, 7, torch.float32, "unused")
    section = RolloutSection(engine="vllm", vllm_server_url=fake.url, vllm_server_timeout=30.0,
                             vllm_group_port=free_port())
    engine = VLLMServerEngine(section, setup, transport=GlooTransport)
    return engine, lambda: [(b["prompt"], b["seed"], b["max_tokens"]) for r, b in fake.calls if r == "/v1/completions"]


@pytest.fixture
def servers():
    started = []
    yield started
    for s in started:
        s.close()


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize("style", ["llama3", "chatml"])
@pytest.mark.parametrize("where", ["colocated", "server"])
def test_token_in_token_out_on_vllm(where, style, monkeypatch, tmp_path, servers):
    tok = tokenizer(style)
    (stop,) = stop_ids(tok, style)
    turns = script(style)
    scripted = Scripted(tok, stop, turns)
    engine, requests = colocated(scripted, monkeypatch, tmp_path) if where == "colocated" else served(scripted,
                                                                                                       servers)
    (tmp_path / "tools.py").write_text(TOOLS)
    tools = {t.name: t for t in load_tools([f"{tmp_path / 'tools.py'}:{n}" for n in ("lookup", "add", "broken")])}
    agent = Agent(tok, CallParser(FORMAT[style], tok, [stop]), [stop], tok.pad_token_id, None, 5.0, 4, CPU)
    user = [[{"role": "user", "content": f"Question {i}?"}] for i in range(3)]
    prompts = [agent.prompt_ids(u, list(tools.values()), 4096) for u in user]
    out = agent.run(engine, prompts, [(i, 0, 0, 0) for i in range(3)], Sampling(BUDGET), [tools] * 3)
    c = out.completions
    assert out.turns == [3, 1, 2] and out.calls == 5 and out.failures == 2 and c.truncated == [False] * 3

    expected = []  # (turn, prompt ids, seed, room) of each request; each trajectory's ids, mask and log-probs
    for i in range(3):
        ids, mask, logps = [], [], []
        tool_messages = [m for m in out.messages[i] if m["role"] == "tool"]
        batches = [tool_messages[:2], tool_messages[2:]] if i == 0 else [tool_messages]
        for t in range(out.turns[i]):
            if t:
                suffix = agent.suffix_ids(batches[t - 1])
                ids, mask, logps = ids + suffix, mask + [0] * len(suffix), logps + [0.0] * len(suffix)
            key = (i, 0, 0, 0) + ((t,) if t else ())
            expected.append((t, prompts[i] + ids, sample_seed(*key), BUDGET - len(ids)))
            sampled = tok(turns[(i, t)], add_special_tokens=False)["input_ids"] + [stop]  # the junk dropped
            ids, mask = ids + sampled, mask + [1] * len(sampled)
            logps += [-(j + 1) / 100 for j in range(len(sampled))]
        assert (c.tokens[i], c.tool_mask[i]) == (ids, mask)
        assert c.logps[i] == pytest.approx(logps)
    # A round is one request per trajectory still calling, max_tokens the most room among them (each is cut at its own)
    width = {t: max(room for u, *_, room in expected if u == t) for t, *_ in expected}
    assert sorted(requests(), key=lambda r: r[1]) == sorted(
        [(ids, seed, width[t]) for t, ids, seed, _ in expected], key=lambda r: r[1])
