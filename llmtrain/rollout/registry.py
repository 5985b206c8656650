"""grpo.engine's choices, built (ENGINES: name -> the Engine's constructor, llmtrain.rollout.engine's signature), and
their set-up check. A module of its own because it names every engine: vllm.py's VLLMEngine builds on engine.py."""

from __future__ import annotations

import re
from importlib.util import find_spec

from llmtrain.config import ConfigError
from llmtrain.rollout.engine import Engine, EngineSetup, LocalEngine, TransformersEngine
from llmtrain.rollout.vllm import VLLMEngine
from llmtrain.rollout.vllm_server import VLLMServerEngine


def vllm(model, model_config, autocast, eos_ids, pad_id, device, setup: EngineSetup) -> Engine:
    """grpo.engine=vllm: on the server grpo.vllm_server_url names, else colocated in each training process."""
    engine = VLLMEngine if setup.vllm_server is None else VLLMServerEngine
    return engine(model, model_config, autocast, eos_ids, pad_id, device, setup)


ENGINES = {"local": LocalEngine, "transformers": TransformersEngine, "vllm": vllm}


def check_engine(name: str, cuda: bool, server_url: str | None) -> None:
    """grpo.engine and grpo.vllm_server_url at set-up, before any process group (the engine's choices are
    GRPOSection's Literal): vllm runs on a CUDA device only (with a server too: rank 0 sends it the weights over
    NCCL) and needs the vllm package (looked up, not imported: importing vllm takes seconds)."""
    if server_url is not None and name != "vllm":
        raise ConfigError(f"grpo.vllm_server_url: a server generates for grpo.engine=vllm only, and grpo.engine is "
                          f"{name}; set grpo.engine=vllm, or leave grpo.vllm_server_url unset")
    if server_url is not None and not re.fullmatch(r"https?://[^/\s:]+(:\d+)?/?", server_url):
        raise ConfigError(f"grpo.vllm_server_url: {server_url!r} is not a server's base URL like http://host:8000")
    if name == "vllm" and not cuda:
        raise ConfigError("grpo.engine: vllm runs on CUDA GPUs only and this run is on CPU; use grpo.engine=local or "
                          "transformers")
    if name == "vllm" and find_spec("vllm") is None:
        raise ConfigError("grpo.engine: vllm is not installed in this environment; pip install vllm (TRL's tested "
                          "0.10.2 to 0.11), or use grpo.engine=local or transformers")
