"""The agent demo's data and template (configs/demo-agent*.yaml, docs/agents.md): every trace of
data/demo/agent/sft.jsonl, rendered by configs/templates/compact-tools.jinja, is short, trains exactly the call and the
answer, shows no digit but the tool's result (the answer is copied or guessed), and is the same ids GRPO assembles from
its prompt (tools= from the demo's Vault environment), the call, the tool message's suffix and the answer; the curve
docs/agents.md quotes is what scripts/curve_figures.py prints from the committed run."""

from __future__ import annotations

import importlib.util
import json
import re

from helpers import REPO
from transformers import AutoTokenizer

from llmtrain.config import DataConfig
from llmtrain.data.formats import IGNORE, encode_chat, prepare_tokenizer
from llmtrain.rollout.agent import Agent, Environments
from llmtrain.rollout.tools import CallParser, as_tool

AGENT = REPO / "data" / "demo" / "agent"
TEMPLATE = REPO / "configs" / "templates" / "compact-tools.jinja"
CALL = '{"name": "read_code", "parameters": {}}'


def records(name: str) -> list[dict]:
    return [json.loads(line) for line in (AGENT / name).read_text().splitlines()]


def test_demo_traces_are_short_copy_tasks_that_grpo_renders_alike():
    tok = AutoTokenizer.from_pretrained(REPO / "assets" / "tokenizer")
    prepare_tokenizer(tok, {"chat", "prompt"}, TEMPLATE.read_text())
    stop = [tok.convert_tokens_to_ids("<|eot_id|>")]
    agent = Agent(tok, CallParser("llama3_json", tok, stop), stop, tok.pad_token_id, None, 1.0, 1, None)
    tool = as_tool(Environments(f"{AGENT / 'vault.py'}:Vault").factories[None]().read_code, "grpo.environment")
    digits = {tok.convert_tokens_to_ids(str(d)) for d in range(10)}
    sft = records("sft.jsonl")
    assert len(sft) == 400
    for record in sft:
        user, _, result, answer = record["messages"]
        assert json.loads(record["tools"]) == [tool.schema]
        ids, labels = encode_chat(record, DataConfig(format="chat"), tok)
        assert len(ids) <= 96  # the schema in one short line: the answer looks back over < 96 positions
        code = result["content"]
        assert re.fullmatch(r"\d", code) and answer["content"] == code
        assert tok.decode([t for t in labels if t != IGNORE]) == f"{CALL}<|eot_id|>{code}<|eot_id|>"
        assert [t for t in ids if t in digits] == [tok.convert_tokens_to_ids(code)] * 2  # the result, the answer
        prompt = agent.prompt_ids([user], [tool], 64)
        turn = tok(CALL, add_special_tokens=False)["input_ids"] + stop
        assert ids == prompt + turn + agent.suffix_ids([result]) + [tok.convert_tokens_to_ids(code)] + stop
        assert agent.parse(turn, prompt, [tool.schema]).calls[0][:2] == ("read_code", {})
    prompts = records("prompts.jsonl")
    assert len(prompts) == 400 and {r["answer"] for r in prompts} == {str(d) for d in range(10)}
    asks = [r["prompt"][0]["content"] for r in prompts] + [r["messages"][0]["content"] for r in sft]
    assert not any(re.search(r"\d", ask) for ask in asks)


def test_the_docs_quote_the_measured_run():
    """docs/agents.md's curve line is what scripts/curve_figures.py prints from the committed run's metrics."""
    spec = importlib.util.spec_from_file_location("curve_figures", REPO / "scripts" / "curve_figures.py")
    curve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(curve)
    doc = " ".join((REPO / "docs" / "agents.md").read_text().split())
    measured = [json.loads(line) for line in (REPO / "docs" / "measured" / "demo-agent.jsonl").read_text().splitlines()]
    assert "python scripts/curve_figures.py outputs/demo-agent --window 25" in doc
    assert "measured/demo-agent.jsonl" in doc and curve.figures(measured, "reward", 25, 10) in doc
