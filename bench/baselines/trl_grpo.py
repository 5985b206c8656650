"""The comparison point of bench/run.py's "grpo" benchmark: TRL's GRPOTrainer on the same prompts, model
directory (model.path), tokenizer, completions per rank (train.micro_batch_size), num_generations,
max_completion_length, temperature, loss_type, beta and ranks as recipes/grpo.py, with the same reward
function (llmtrain.rewards:format_regex, called with TRL's own signature), full fine-tuning, fp32, without
vLLM (transformers' generate on the unwrapped model, TRL's default). TRL defaults otherwise, except two
that TRL changes from TrainingArguments and that would make the comparison unequal: gradient checkpointing
and bf16, both on in TRL, off here as in the recipe. Runs in TRL's own virtual environment (bench/run.py's
trl_python).

    torchrun --standalone --nproc_per_node=2 bench/baselines/trl_grpo.py --config GRPO.yaml \
        --data data/demo/prompts.jsonl --steps 12 --warmup 3 --output-dir DIR --out result.json

Timing and the output JSON are bench/baselines/hf_trainer.py's; a step is generation, scoring and the update (one
generation batch per step: steps_per_generation = gradient_accumulation_steps = 1). Trained tokens are
TRL's completion_mask (each completion up to and including its EOS), counted as the loss sees them.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # llmtrain.rewards: TRL's venv does not install llmtrain

import trl
import yaml
from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

from hf_trainer import load_tokenizer, parse_args, train_and_report, training_kwargs
from llmtrain import rewards


class CountingGRPOTrainer(GRPOTrainer):
    """Counts, per optimizer step, the completion tokens the loss trains (with tools, TRL's completion_mask x
    tool_mask: tool results are out of the loss), the tokens pushed through (prompt + completion, padded) and the real
    ones: after generation, where TRL's inputs carry the masks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_trained, self.step_tokens, self.step_real = 0, 0, 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        completion, prompt = inputs["completion_mask"], inputs["prompt_mask"]
        trained = completion * inputs["tool_mask"] if "tool_mask" in inputs else completion
        self.step_trained += int(trained.sum())
        self.step_tokens += completion.numel() + prompt.numel()
        self.step_real += int(completion.sum() + prompt.sum())
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def main() -> None:
    args = parse_args(__doc__)
    cfg = yaml.safe_load(open(args.config))
    g = cfg["grpo"]
    tok = load_tokenizer(cfg)
    config = GRPOConfig(**training_kwargs(cfg, args), num_generations=g["num_generations"],
                        max_completion_length=g["max_completion_length"], temperature=g["temperature"],
                        loss_type=g["loss_type"], beta=g["beta"], gradient_checkpointing=False, bf16=False,
                        model_init_kwargs={"dtype": "float32"}, log_completions=False)
    funcs = [getattr(rewards, spec.split(":")[1]) for spec in g["reward_funcs"]]
    ds = load_dataset("json", data_files=args.data, split="train")
    trainer = CountingGRPOTrainer(model=cfg["model"]["path"], reward_funcs=funcs, args=config, train_dataset=ds,
                                  processing_class=tok)
    train_and_report(trainer, args, {
        "trl": trl.__version__, "loss_type": config.loss_type, "beta": config.beta,
        "num_generations": config.num_generations, "max_completion_length": config.max_completion_length,
        "generation_batch_size": config.generation_batch_size, "use_vllm": config.use_vllm,
        "gradient_checkpointing": config.gradient_checkpointing, "bf16": config.bf16, "optim": str(config.optim),
        "attn_implementation": trainer.model.config._attn_implementation})


if __name__ == "__main__":
    main()
