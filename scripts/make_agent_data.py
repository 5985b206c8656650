"""The agent demo's data (configs/demo-agent-sft.yaml, configs/demo-agent.yaml): data/demo/agent/sft.jsonl, tool-calling
conversations in TRL's SFT format (a `tools` column, an assistant turn calling read_code, the tool's result, the
answer), and data/demo/agent/prompts.jsonl, GRPO's prompts with each episode's code as the `answer` column (the
environment, data/demo/agent/vault.py, holds it). The code is one digit and the prompts hold none, so the tool's
result is the only digit a trace shows: an answer is right by copying it or by chance (1 in 10).
Deterministic: python scripts/make_agent_data.py"""

import importlib.util
import json
import random
from pathlib import Path

from transformers.utils import get_json_schema

HERE = Path(__file__).resolve().parents[1] / "data" / "demo" / "agent"
ASKS = ["The {v} vault's code?", "Open the {v} vault.", "What opens the {v} vault?", "Code of the {v} vault?"]
VAULTS = ["red", "blue", "green", "old", "small", "big", "iron", "gold"]


def main() -> None:
    spec = importlib.util.spec_from_file_location("vault", HERE / "vault.py")
    vault = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vault)
    tools = [get_json_schema(vault.Vault().read_code)]
    rng = random.Random(0)

    def episode() -> tuple[list[dict], str]:
        ask = rng.choice(ASKS).format(v=rng.choice(VAULTS))
        return [{"role": "user", "content": ask}], str(rng.randrange(10))

    with open(HERE / "sft.jsonl", "w") as f:
        for _ in range(400):
            prompt, code = episode()
            call = {"type": "function", "function": {"name": "read_code", "arguments": {}}}
            messages = prompt + [{"role": "assistant", "content": "", "tool_calls": [call]},
                                 {"role": "tool", "name": "read_code", "content": code},
                                 {"role": "assistant", "content": code}]
            f.write(json.dumps({"messages": messages, "tools": json.dumps(tools)}) + "\n")
    with open(HERE / "prompts.jsonl", "w") as f:
        for _ in range(400):
            prompt, code = episode()
            f.write(json.dumps({"prompt": prompt, "answer": code}) + "\n")


if __name__ == "__main__":
    main()
