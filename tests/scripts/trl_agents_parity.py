"""llmtrain's tool-message tokens (llmtrain.rollout.agent.Agent.suffix_ids) against TRL's own
GRPOTrainer._get_tool_suffix_ids, and its tool messages' content against TRL's _tool_call_loop's (str(result)), on
the same tokenizer and chat templates (configs/templates/llama3-tools.jinja and chatml-tools.jinja).

TRL is a dev-only comparison, kept out of llmtrain's environment; run this with TRL 1.16.0 importable (installed
without its dependencies beside llmtrain's venv), from the repo root:

    PYTHONPATH=/path/to/trl-pkgs .venv/bin/python tests/scripts/trl_agents_parity.py

Prints, per template and set of tool messages, whether the token ids are identical; exits non-zero when one differs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

import torch  # noqa: E402
from helpers.agents import FORMAT, stop_ids, tokenizer  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from llmtrain.rollout.agent import Agent  # noqa: E402
from llmtrain.rollout.tools import CallParser, Outcome  # noqa: E402

MESSAGES = {
    "one result": [Outcome("lookup", "42", False).message()],
    "two results": [Outcome("lookup", "42", False).message(), Outcome("add", 5, False).message()],
    "an error": [Outcome("lookup", {"error": "Tool lookup not found."}, True).message()],
}


def main() -> int:
    failed = 0
    for style in ("llama3", "chatml"):
        tok = tokenizer(style)
        stop = stop_ids(tok, style)
        agent = Agent(tok, CallParser(FORMAT[style], tok, stop), stop, tok.pad_token_id, None, 1.0, 1,
                      torch.device("cpu"))
        trl = SimpleNamespace(processing_class=tok, chat_template=None, chat_template_kwargs={}, _is_vlm=False,
                              _tokenizer=tok)
        for name, messages in MESSAGES.items():
            ours, theirs = agent.suffix_ids(messages), GRPOTrainer._get_tool_suffix_ids(trl, messages)
            same = ours == theirs
            failed += not same
            print(f"{style:7s} {name:12s} {'identical' if same else 'DIFFERENT'} ({len(ours)} vs {len(theirs)} tokens)"
                  f": {tok.decode(ours)!r}")
    for result in ("42", 5, {"error": "Tool nope not found."}):  # TRL: str(result) (a list, content blocks, aside)
        same = Outcome("t", result, False).message()["content"] == str(result)
        failed += not same
        print(f"tool message content of {result!r}: {'identical' if same else 'DIFFERENT'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
