"""The comparison point of bench/run.py's "reward" benchmark: TRL's RewardTrainer on the same preference pairs,
model directory (model.path, a causal LM: TRL puts AutoModelForSequenceClassification's score head on it, as
recipes/reward.py does), tokenizer, micro-batch (pairs per rank), max length and ranks as recipes/reward.py: the
config's reward.center_rewards_coefficient, full fine-tuning, fp32. TRL defaults otherwise, except two that TRL
changes from TrainingArguments and that would make the comparison unequal: gradient checkpointing and bf16, both
on in TRL, off here as in the recipe. Runs in TRL's own virtual environment (bench/run.py's trl_python).

    torchrun --standalone --nproc_per_node=2 bench/baselines/trl_reward.py --config REWARD.yaml \
        --data data/demo/preference.jsonl --steps 30 --warmup 5 --output-dir DIR --out result.json

Counting, timing and the output JSON are bench/baselines/hf_trainer.py's; "trained" here counts pairs (half the rows
of a micro-batch), so useful_tokens_per_sec is pairs/s.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trl
import yaml
from datasets import load_dataset
from trl import RewardConfig, RewardTrainer

from hf_trainer import Counting, load_tokenizer, parse_args, train_and_report, training_kwargs


class CountingRewardTrainer(Counting, RewardTrainer):
    def count(self, inputs: dict) -> tuple[int, int, int]:
        ids = inputs["input_ids"]
        return ids.shape[0] // 2, ids.numel(), int(inputs["attention_mask"].sum())


def main() -> None:
    args = parse_args(__doc__)
    cfg = yaml.safe_load(open(args.config))
    tok = load_tokenizer(cfg)
    config = RewardConfig(**training_kwargs(cfg, args), max_length=cfg["data"]["seq_len"],
                          center_rewards_coefficient=cfg["reward"]["center_rewards_coefficient"] or None,
                          gradient_checkpointing=False, bf16=False, model_init_kwargs={"dtype": "float32"})
    ds = load_dataset("json", data_files=args.data, split="train")
    trainer = CountingRewardTrainer(model=cfg["model"]["path"], args=config, train_dataset=ds, processing_class=tok)
    train_and_report(trainer, args, {
        "trl": trl.__version__, "center_rewards_coefficient": config.center_rewards_coefficient,
        "max_length": config.max_length, "gradient_checkpointing": config.gradient_checkpointing,
        "bf16": config.bf16, "optim": str(config.optim), "pairs": len(trainer.train_dataset),
        "attn_implementation": trainer.model.config._attn_implementation})


if __name__ == "__main__":
    main()
