"""The rollout: config section (RolloutSection: which engine samples an on-policy recipe's completions, and the
vLLM engine's keys) and its set-up check (check_engine, before any process group). GRPO's and on-policy
distillation's configs both carry it; llmtrain.rollout.registry.build makes the engine from it. The sampling
settings stay with each recipe (grpo.temperature, top_p, top_k, max_completion_length; distill.max_new_tokens,
sampling_temperature): they are also the recipe's loss settings, and the recipe hands them to every generate call."""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Literal

from llmtrain.config import ConfigError, ranged


@dataclass
class RolloutSection:
    engine: Literal["local", "transformers", "vllm"] = "local"
    """What samples the completions: local (llmtrain.rollout.local's keyed sampler on the training model, the
    same completions at any world size, strategy or resume); transformers (transformers' continuous batching on
    each rank's own fp32 copy of the policy, its weights pushed and fingerprint-checked at every generation
    batch; reproducible for the same rows, not at another world size or split); vllm (vLLM colocated in each
    training process on CUDA, its own copy in the compute dtype, pushed and checked the same way, or on the
    server rollout.vllm_server_url names; needs `pip install vllm`, not tested on a GPU yet: docs/grpo.md)."""
    vllm_gpu_memory_utilization: float = ranged("(0, 1]", default=0.3)
    """rollout.engine=vllm: the fraction of the GPU's memory vLLM takes for its weights, activations and KV cache
    (TRL's vllm_gpu_memory_utilization); the training's model, gradients and optimizer need the rest."""
    vllm_enable_sleep_mode: bool = False
    """rollout.engine=vllm: vLLM sleeps between generations (weights offloaded to the CPU, KV cache freed), so
    training gets its memory back; costs a copy back before each push (TRL's vllm_enable_sleep_mode)."""
    vllm_server_url: str | None = None
    """rollout.engine=vllm: the base URL (http://host:8000) of a vLLM server on GPUs of its own to generate on, rank
    0 pushing it the weights over NCCL (TRL's vllm_mode=server, vllm_server_base_url); started as docs/grpo.md
    shows. None: vLLM colocated in the training processes (rollout.vllm_gpu_memory_utilization and
    _enable_sleep_mode)."""
    vllm_server_timeout: float = ranged("(0, inf)", default=240.0)
    """rollout.vllm_server_url: seconds to wait for the server at start (until /health answers) and for each of its
    answers (TRL's vllm_server_timeout)."""
    vllm_group_port: int = ranged("[1, 65535]", default=51216)
    """rollout.vllm_server_url: the port on rank 0's host of the NCCL group that sends the weights to the server's
    workers (TRL's vllm_group_port)."""


def check_engine(section: RolloutSection, cuda: bool) -> None:
    """rollout.engine and rollout.vllm_server_url at set-up, before any process group (the engine's choices are
    RolloutSection's Literal): vllm runs on a CUDA device only (with a server too: rank 0 sends it the weights over
    NCCL) and needs the vllm package (looked up, not imported: importing vllm takes seconds)."""
    name, server_url = section.engine, section.vllm_server_url
    if server_url is not None and name != "vllm":
        raise ConfigError(f"rollout.vllm_server_url: a server generates for rollout.engine=vllm only, and "
                          f"rollout.engine is {name}; set rollout.engine=vllm, or leave rollout.vllm_server_url unset")
    if server_url is not None and not re.fullmatch(r"https?://[^/\s:]+(:\d+)?/?", server_url):
        raise ConfigError(f"rollout.vllm_server_url: {server_url!r} is not a server's base URL like http://host:8000")
    if name == "vllm" and not cuda:
        raise ConfigError("rollout.engine: vllm runs on CUDA GPUs only and this run is on CPU; use "
                          "rollout.engine=local or transformers")
    if name == "vllm" and find_spec("vllm") is None:
        raise ConfigError("rollout.engine: vllm is not installed in this environment; pip install vllm (TRL's tested "
                          "0.10.2 to 0.11), or use rollout.engine=local or transformers")
