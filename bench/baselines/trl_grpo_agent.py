"""The comparison point of bench/run.py's "agent" benchmark: TRL's GRPOTrainer(environment_factory=...) in the agent
demo's environment (data/demo/agent/vault.py's Vault, grpo.environment), from the same model directory (model.path),
tokenizer and chat template (data.chat_template, with Llama 3.1's JSON calls: TRL's llama3 response template parses
them, anchored at the template's own generation prompt), on the same prompts, completions per rank, num_generations,
max_completion_length, temperature, loss_type, beta, max_tool_calling_iterations and ranks as recipes/grpo.py, with
the same reward (llmtrain.rewards:exact_answer, called with TRL's own signature), full fine-tuning, fp32, without vLLM
(TRL's default generate). Gradient checkpointing and bf16 off as in the recipe (TRL turns both on). Runs in TRL's own
virtual environment.

    torchrun --standalone --nproc_per_node=2 bench/baselines/trl_grpo_agent.py --config GRPO.yaml \
        --data data/demo/agent/prompts.jsonl --steps 6 --warmup 2 --output-dir DIR --out result.json

Timing and the output JSON are bench/baselines/hf_trainer.py's, the counting trl_grpo.py's: trained tokens are the
trajectory tokens the loss covers, TRL's completion_mask x tool_mask (the model's tokens, tool results out), as the
recipe's trained_tokens; the JSON adds TRL's logged tools/call_frequency and tools/failure_frequency
(tools_call_frequency, tools_failure_frequency: one value per log).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # llmtrain.rewards: TRL's venv does not install llmtrain

import trl
import yaml
from datasets import load_dataset
from trl import GRPOConfig
from transformers import AutoModelForCausalLM, TrainerCallback
from trl.chat_template_utils import llama3_template

from hf_trainer import load_tokenizer, parse_args, train_and_report, training_kwargs
from trl_grpo import CountingGRPOTrainer
from llmtrain import rewards


def environment(spec: str) -> type:
    """grpo.environment's 'path.py:Factory'."""
    path, name = spec.rsplit(":", 1)
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


class ToolCalls(TrainerCallback):
    """TRL's tools/* metrics as it logs them, into `logged` (a list per metric)."""

    def __init__(self, logged: dict[str, list[float]]):
        self.logged = logged

    def on_log(self, args, state, control, logs=None, **kwargs):
        for key, values in self.logged.items():
            if logs and key in logs:
                values.append(float(logs[key]))


def main() -> None:
    args = parse_args(__doc__)
    cfg = yaml.safe_load(open(args.config))
    g = cfg["grpo"]
    tok = load_tokenizer({"tokenizer": {"path": cfg["model"]["path"]}})
    tok.chat_template = Path(cfg["data"]["chat_template"]).read_text()
    # The template writes Llama 3.1's JSON calls; a turn starts after its generation prompt (its assistant header)
    turn = [{"role": "user", "content": "x"}]
    header = tok.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)[
        len(tok.apply_chat_template(turn, tokenize=False)):]
    tok.response_template = {**llama3_template, "start_anchor": header}
    config = GRPOConfig(**training_kwargs(cfg, args), num_generations=g["num_generations"],
                        max_completion_length=g["max_completion_length"], temperature=g["temperature"],
                        loss_type=g["loss_type"], beta=g["beta"], gradient_checkpointing=False, bf16=False,
                        max_tool_calling_iterations=g.get("max_tool_calling_iterations"),
                        log_completions=False)
    funcs = [getattr(rewards, spec.split(":")[1]) for spec in g["reward_funcs"]]
    ds = load_dataset("json", data_files=args.data, split="train")
    # Built here, fp32: an export of an inline model config names no architectures, which TRL's loading by path needs
    model = AutoModelForCausalLM.from_pretrained(cfg["model"]["path"], dtype="float32")
    trainer = CountingGRPOTrainer(model=model, reward_funcs=funcs, args=config, train_dataset=ds,
                                  processing_class=tok, environment_factory=environment(g["environment"]))
    tools = {"tools/call_frequency": [], "tools/failure_frequency": []}
    trainer.add_callback(ToolCalls(tools))
    train_and_report(trainer, args, {
        "trl": trl.__version__, "loss_type": config.loss_type, "beta": config.beta,
        "num_generations": config.num_generations, "max_completion_length": config.max_completion_length,
        "max_tool_calling_iterations": config.max_tool_calling_iterations,
        "generation_batch_size": config.generation_batch_size, "use_vllm": config.use_vllm,
        "gradient_checkpointing": config.gradient_checkpointing, "bf16": config.bf16, "optim": str(config.optim),
        "attn_implementation": trainer.model.config._attn_implementation,
        **{key.replace("/", "_"): values for key, values in tools.items()}})


if __name__ == "__main__":
    main()
