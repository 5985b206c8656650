"""GRPO's configuration (llmtrain.recipes.grpo): its usage text, the grpo: section, its Config (with the rollout:
section, llmtrain.rollout.section) and its set-up checks across keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from llmtrain import rewards
from llmtrain.config import Config, ConfigError, input_path, ranged
from llmtrain.rollout.section import RolloutSection

USAGE = """\
GRPO / DAPO / Dr. GRPO with DDP, FSDP or FSDP2 on GPUs (NCCL) or CPUs (gloo).

  torchrun --nproc_per_node=N recipes/grpo.py --config configs/demo-grpo.yaml [key.sub=value ...]

The data are prompts (data.format: prompt): {"prompt": text or a list of messages, ...}; every other column
reaches the reward functions (grpo.reward_funcs) by name. Each step trains on micro_batch_size x
grad_accum_steps x world size completions: that many / grpo.num_generations prompts, each sampled
grpo.num_generations times. data.seq_len is the prompt's budget (longer prompts keep their last tokens).

Writes to output_dir what recipes/finetune.py writes; metrics.jsonl adds TRL's names: reward, reward_std,
rewards/<func>/mean and /std, frac_reward_zero_std, kl (grpo.beta > 0), completions/mean_length, /min_length,
/max_length, /clipped_ratio, clip_ratio/low_mean, /high_mean, /region_mean, and generation_s,
generated_tokens_per_s, and the drift guard's sampling/logprob_diff/mean, /max, sampling/importance_ratio/min,
/mean, /max (grpo.importance_correction); log.completions_every_steps: sampled completions to
output_dir/completions.jsonl.

Tool use (grpo.tools, grpo.environment; docs/agents.md): multi-turn trajectories, tools/call_frequency,
/failure_frequency and /mean_turns logged, completions.jsonl's records carry the trajectories' messages.
"""

def environment_file(value) -> str | None:
    """The file grpo.environment reads (one factory; a mapping's are checked when loaded)."""
    return rewards.file_of(value) if isinstance(value, str) else None


@dataclass
class GRPOSection:
    num_generations: int = ranged("[2, inf)", default=8)
    """G: completions sampled per prompt (>= 2); a group's advantages are relative to its own mean."""
    max_completion_length: int = ranged("[1, inf)", default=256)
    """Tokens sampled per completion at most; also dr_grpo's constant denominator."""
    temperature: float = ranged("(0, inf)", default=1.0)
    """Sampling temperature; the log-probs of the loss use the same (logits / temperature, as TRL)."""
    top_p: float = ranged("(0, 1]", default=1.0)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1: off)."""
    top_k: int = ranged("[0, inf)", default=0)
    """Keep the top_k most likely tokens only (0: off)."""
    epsilon: float = ranged("[0, 1)", default=0.2)
    """Lower clipping bound of the ratio: 1 - epsilon."""
    epsilon_high: float | None = ranged("[0, inf)", default=None)
    """Upper clipping bound: 1 + epsilon_high (None: epsilon; DAPO's clip-higher uses 0.28)."""
    beta: float = ranged("[0, inf)", default=0.0)
    """KL penalty to the reference model (k3 estimator); 0 builds no reference."""
    use_bias_correction_kl: bool = True
    """beta > 0: multiply the per-token KL by the importance ratio (TRL 1.16's default, DeepSeek-V3.2)."""
    num_iterations: int = ranged("[1, inf)", default=1)
    """Updates per generation batch (mu); > 1 takes the ratio against the log-probs at sampling time."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """How per-token losses are aggregated (llmtrain/losses/policy.py's docstring): grpo (mean per completion,
    then over completions) | bnpo, dapo (mean over the global batch's tokens) | dr_grpo (sum / (completions x
    max_completion_length))."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantage scaling: divide by the group's reward std (group), the batch's (batch) or not at all (none,
    Dr. GRPO's recommendation)."""
    mask_truncated_completions: bool = False
    """Leave completions that reached max_completion_length without an EOS out of the loss (DAPO)."""
    reward_funcs: list[str] = input_path(rewards.file_of, default_factory=list)
    """Reward functions, "package.module:function" or "path/to/file.py:function", each called as TRL does:
    f(prompts, completions, completion_ids, **columns) -> list[float | None]. Built-ins:
    llmtrain.rewards:exact_answer, llmtrain.rewards:format_regex. A directory is a reward model (a sequence
    classifier with one label, e.g. recipes/reward.py's export): prompt + completion scored with its own tokenizer
    and chat template, frozen beside the policy under its strategy; named (rewards/<name>/*) by the directory."""
    reward_weights: list[float] = ranged("[0, inf)", default_factory=list)
    """One weight per reward function (empty: all 1); a penalty is a function returning negative rewards."""
    importance_correction: Literal["none", "tis", "mis"] = "none"
    """Correct for the engine's log-probs differing from the trainer's (TRL's vllm_importance_sampling_*): tis
    multiplies each token's policy-gradient loss by min(exp(trainer - engine log-prob), importance_cap)
    (truncated importance sampling), mis by that ratio where it is <= importance_cap and 0 beyond (masked);
    none logs the ratio (sampling/importance_ratio/*) only."""
    importance_cap: float = ranged("(0, inf)", default=2.0)
    """C of grpo.importance_correction: tis truncates the ratio at C, mis masks what exceeds C."""
    importance_level: Literal["token", "sequence"] = "token"
    """grpo.importance_correction's ratio per token, or per completion (exp of the sum of its tokens' log-prob
    differences, applied to all its tokens; TRL's sequence_* modes)."""
    tools: list[str] = input_path(rewards.file_of, default_factory=list)
    """Tools the model may call (TRL's tools=): "path/to/file.py:function" or "package.module:function", plain
    functions (sync or async) with type hints and a Google-style docstring; their JSON schemas (transformers'
    get_json_schema) are rendered into each prompt by the chat template's tools=. Needs chat prompts and a chat
    template that renders tools (docs/agents.md)."""
    environment: str | dict | None = input_path(environment_file, default=None)
    """An environment class or factory (TRL's environment_factory=), "path/to/file.py:Factory", one instance per
    trajectory: reset(**row) may return text appended to the last user message, its public methods are tools, its
    get_reward() a reward (rewards/<Class>/...; grpo.reward_funcs become optional). Or a mapping name: Factory with
    an `environment` column choosing one per row."""
    tool_call_format: Literal["auto", "hermes", "llama3_json"] = "auto"
    """How tool calls are read from a sampled turn: auto (the tokenizer's response template, transformers'
    parse_response; refused when it has none), hermes (Qwen / Hermes <tool_call>{"name": ..., "arguments": ...}
    </tool_call>), llama3_json (Llama 3.x: the message is {"name": ..., "parameters": ...})."""
    max_tool_calling_iterations: int | None = ranged("[0, inf)", default=None)
    """Rounds of tool calls (then sampling again) per trajectory at most (TRL's name; None: until the model stops
    calling or grpo.max_completion_length, which bounds the whole trajectory, is reached)."""
    tool_timeout_s: float = ranged("(0, inf)", default=30.0)
    """Seconds one tool call may take; beyond, it is a failure ({"error": ...} goes back to the model)."""
    max_concurrent_tool_calls: int = ranged("[1, inf)", default=8)
    """Tool calls of different trajectories run at once on a rank (a bounded pool of threads)."""
    reward_timeout_s: float | None = ranged("(0, inf)", default=None)
    """Seconds a reward function's call may take on a rank; beyond, the run stops (exit 1) with one line naming
    the function and the rank. Must be below distributed.timeout_s (None: half of it)."""


@dataclass
class GRPOConfig(Config):
    """recipes/grpo.py's Config: the shared sections plus grpo: and rollout:."""
    grpo: GRPOSection = field(default_factory=GRPOSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)


def check(section: GRPOSection, environment_rewards: int = 0) -> None:
    """Set-up checks across grpo.* keys (each key's own range and choices are load_config's: GRPOSection's
    ranged and Literal fields); environment_rewards: the get_reward functions of grpo.environment's classes."""
    funcs = len(section.reward_funcs) + environment_rewards
    if not funcs:
        raise ConfigError("grpo.reward_funcs: name at least one reward function, e.g. [llmtrain.rewards:exact_answer] "
                          "(or give grpo.environment a get_reward method)")
    if section.reward_weights and len(section.reward_weights) != funcs:
        raise ConfigError(f"grpo.reward_weights: {len(section.reward_weights)} weights for "
                          f"{len(section.reward_funcs)} grpo.reward_funcs"
                          f"{f' and {environment_rewards} environment get_reward' if environment_rewards else ''}; "
                          "give one per function")


def check_batch(cfg: GRPOConfig, world_size: int) -> None:
    """A step's completions (micro x accumulation x ranks) are whole groups of grpo.num_generations."""
    completions = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * world_size
    if completions % cfg.grpo.num_generations:
        raise ConfigError(f"train.micro_batch_size x train.grad_accum_steps x {world_size} ranks = {completions} "
                          f"completions per step must be a multiple of grpo.num_generations = "
                          f"{cfg.grpo.num_generations}")
