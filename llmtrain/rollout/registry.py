"""grpo.engine's choices, built (ENGINES: name -> the Engine class, llmtrain.rollout.engine's constructor), and their
set-up check. A module of its own because it names every engine: vllm.py's VLLMEngine builds on engine.py."""

from __future__ import annotations

from importlib.util import find_spec

from llmtrain.config import ConfigError
from llmtrain.rollout.engine import LocalEngine, TransformersEngine
from llmtrain.rollout.vllm import VLLMEngine

ENGINES = {"local": LocalEngine, "transformers": TransformersEngine, "vllm": VLLMEngine}


def check_engine(name: str, cuda: bool) -> None:
    """grpo.engine at set-up, before any process group (its choices are GRPOSection's Literal): vllm runs on a CUDA
    device only, and needs the vllm package (looked up, not imported: importing vllm takes seconds)."""
    if name == "vllm" and not cuda:
        raise ConfigError("grpo.engine: vllm runs on CUDA GPUs only and this run is on CPU; use grpo.engine=local or "
                          "transformers")
    if name == "vllm" and find_spec("vllm") is None:
        raise ConfigError("grpo.engine: vllm is not installed in this environment; pip install vllm (TRL's tested "
                          "0.10.2 to 0.11), or use grpo.engine=local or transformers")
