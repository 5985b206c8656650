"""`agent` (python bench/run.py --only agent): multi-turn tool-use GRPO, recipes/grpo.py vs TRL's GRPOTrainer with
environment_factory (bench/baselines/trl_grpo_agent.py, TRL's venv), in the agent demo's environment
(data/demo/agent/vault.py, its read_code tool) from one model directory of llama-32k's shape
(bench/configs/llama-32k-agent.yaml: ddp, 2 ranks, G 4, at most 2 rounds of calls, no vLLM). A random model never
calls the tool, so both sides start from one short SFT of it on the demo's tool-calling traces
(data/demo/agent/sft.jsonl). Trajectory tokens trained/s (the model's tokens of every turn, tool results out; whole
steps: sampling, tool calls and the update) and peak memory per rank, --pairs pairs. Target >= 1.5x."""

from __future__ import annotations

from pathlib import Path

import yaml

from benchmarks.base import BENCH, SHAPE_32K, TIMEOUT, Ctx, describe_shape, ratio, write_config
from benchmarks.versus import GRPO_RECIPE, recipe_vs_trl, vs_trl_table
from common import RECIPE, REPO, median, torchrun, train_records

SHAPE_AGENT = BENCH / "configs" / "llama-32k-agent.yaml"
WARM_STEPS = 60  # SFT steps after which the random model calls read_code on (nearly) every prompt


def warm(ctx: Ctx, random_dir: Path) -> Path:
    """The random model after WARM_STEPS of SFT on the demo's tool-calling traces, rendered by the benchmark's chat
    template: its export, which both sides start from."""
    work = ctx.dir("agent")
    data = yaml.safe_load(SHAPE_AGENT.read_text())["data"]
    cfg = write_config(work / "sft.yaml", SHAPE_32K, {
        "model": {"path": str(random_dir), "config": None},
        "data": {"path": "data/demo/agent/sft.jsonl", "format": "chat", "chat_template": data["chat_template"],
                 "seq_len": 192},
        "parallel": {"strategy": "ddp"},
        "train": {"max_steps": WARM_STEPS, "micro_batch_size": 8, "lr": 3.0e-3, "warmup_steps": 5,
                  "lr_schedule": "constant"}})
    torchrun([RECIPE, "--config", cfg, f"output_dir={work / 'sft'}", "log.progress=false", "checkpoint.resume=never"],
             timeout=TIMEOUT, log=work / "sft.log")
    return work / "sft" / "hf"


def bench(ctx: Ctx) -> dict:
    """Trajectory tokens trained per second of recipes/grpo.py vs TRL's GRPOTrainer(environment_factory=), one warmed
    model directory, ddp, 2 ranks."""
    steps, warmup, window = (5, 2, 2) if ctx.quick else (12, 3, 3)
    versus = recipe_vs_trl(ctx, "agent", GRPO_RECIPE, SHAPE_AGENT, "trl_grpo_agent.py", steps, warmup, window,
                           warm=lambda random_dir: warm(ctx, random_dir))
    runs, c = versus.runs, yaml.safe_load(versus.config.read_text())
    g = c["grpo"]
    v = vs_trl_table(runs, "GRPOTrainer", "trajectory tokens trained", window)
    a, b = runs[-1]
    work = ctx.dir("agent")
    ours = [r for i in range(len(runs)) for r in train_records(work / f"recipe_{i}")]

    def tools(key: str) -> str:  # median over the logged steps, recipe and TRL
        return (f"recipe {median([r[f'tools/{key}'] for r in ours]):.2f}, TRL "
                f"{median([x for _, t in runs for x in t[f'tools_{key}']]):.2f}")
    per_rank = c["train"]["micro_batch_size"]
    text = v.table + (
        f"\n\nShape: {describe_shape(SHAPE_32K).split(', seq')[0]}; one random model directory "
        f"(bench/benchmarks/memory/probe.py --export) given {WARM_STEPS} steps of SFT on data/demo/agent/sft.jsonl "
        f"(recipes/finetune.py), whose export both sides start from. Environment {g['environment']} (one instance per "
        f"trajectory, its read_code the tool), prompts {c['data']['path']}, chat template {c['data']['chat_template']} "
        f"(tool_call_format {g['tool_call_format']}; TRL parses the calls with its llama3 response template), "
        f"{per_rank} trajectories per rank a step ({per_rank // g['num_generations']} prompts x G "
        f"{g['num_generations']}), max_tool_calling_iterations {g['max_tool_calling_iterations']}, "
        f"max_completion_length {g['max_completion_length']} for the whole trajectory, temperature {g['temperature']}, "
        f"loss_type {g['loss_type']}, beta {g['beta']}, reward {', '.join(g['reward_funcs'])}, 2 ranks gloo, DDP, "
        f"fp32, full fine-tuning, no vLLM on either side. Both call the tool: calls per trajectory (median of the "
        f"logged steps) {tools('call_frequency')}; failed calls per call {tools('failure_frequency')}. Trained = "
        f"the model's tokens of every turn up to and including its end-of-turn token (TRL: completion_mask x "
        f"tool_mask), all ranks; median per step: recipe {median(a['tokens'][warmup:]):,.0f}, TRL "
        f"{median(b['step_trained_tokens'][warmup:]):,.0f} (each side "
        f"samples with its own generator, so the trajectories differ). A step is the whole of it: sampling, tool "
        f"calls, rewards, the update; in the recipe sampling (tool calls included) took {a['sampling_share']:.0%} of "
        f"the step (median). TRL {b['trl']} GRPOTrainer: gradient checkpointing {b['gradient_checkpointing']} and "
        f"bf16={b['bf16']} (TRL turns both on by default), use_vllm={b['use_vllm']}, generation_batch_size "
        f"{b['generation_batch_size']}, optimizer {b['optim']}, attention {b['attn_implementation']}; TRL defaults "
        f"otherwise, in its own venv ({ctx.trl_venv_shown}). {steps} steps, the first {warmup} left out; time from "
        f"rank 0 at the end of each step. Peak memory: peak RSS of the process, max over ranks. Spread of the per-pair "
        f"ratios: {max(v.ratios) / min(v.ratios):.2f}x.")
    name = "agent: recipe / TRL GRPOTrainer(environment_factory)"
    return {"title": "Tool-use GRPO: trajectory tokens trained/s vs TRL GRPOTrainer(environment_factory)",
            "table": text,
            "ratios": [ratio(f"{name} trajectory tokens trained/s", median(v.ratios), 1.5),
                       ratio(f"{name}, best window", median(v.best), 1.5),
                       ratio(f"{name} peak memory per rank", median(v.mem))],
            "raw": {"runs": runs, "ratios": v.ratios, "best_window_ratios": v.best, "memory_ratios": v.mem,
                    "steps": steps, "warmup": warmup, "warm_steps": WARM_STEPS,
                    "config": str(SHAPE_AGENT.relative_to(REPO))}}
