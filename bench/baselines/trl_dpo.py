"""The comparison point of bench/run.py's "dpo" benchmark: TRL's DPOTrainer on the same preference pairs,
model directory (model.path), tokenizer, micro-batch (pairs per rank), max length and ranks as recipes/dpo.py:
sigmoid loss, the config's dpo.beta, a live frozen reference (TRL loads a second copy of model.path), full
fine-tuning, fp32. TRL defaults otherwise, except two that TRL changes from TrainingArguments and that would
make the comparison unequal: activation (gradient) checkpointing and bf16, both on in TRL, off here as in the
recipe. precompute_ref_log_probs stays off (TRL's default) and padding_free stays off (TRL's default, and
TRL 1.16 ignores it for DPO): each micro-batch is padded to its longest row, as the recipe's collate does.
Runs in TRL's own virtual environment (bench/run.py's trl_python).

    torchrun --standalone --nproc_per_node=2 bench/baselines/trl_dpo.py --config DPO.yaml \
        --data data/demo/preference.jsonl --steps 30 --warmup 5 --output-dir DIR --out result.json

Counting, timing and the output JSON are bench/baselines/hf_trainer.py's; trained tokens here are the response
tokens of chosen and rejected rows (TRL's completion_mask, from position 1: what carries a log-prob).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trl
import yaml
from datasets import load_dataset
from trl import DPOConfig, DPOTrainer

from hf_trainer import Counting, load_tokenizer, parse_args, train_and_report, training_kwargs


class CountingDPOTrainer(Counting, DPOTrainer):
    def count(self, inputs: dict) -> tuple[int, int, int]:
        completion = inputs["completion_mask"]
        return int(completion[:, 1:].sum()), completion.numel(), int(inputs["attention_mask"].sum())


def main() -> None:
    args = parse_args(__doc__)
    cfg = yaml.safe_load(open(args.config))
    dpo = cfg["dpo"]
    tok = load_tokenizer(cfg)
    config = DPOConfig(**training_kwargs(cfg, args), max_length=cfg["data"]["seq_len"], loss_type=[dpo["loss"]],
                       beta=dpo["beta"], activation_checkpointing=False, bf16=False, precompute_ref_log_probs=False,
                       model_init_kwargs={"dtype": "float32"})
    ds = load_dataset("json", data_files=args.data, split="train")
    trainer = CountingDPOTrainer(model=cfg["model"]["path"], args=config, train_dataset=ds, processing_class=tok)
    train_and_report(trainer, args, {
        "trl": trl.__version__, "loss_type": config.loss_type, "beta": config.beta, "max_length": config.max_length,
        "truncation_mode": config.truncation_mode, "padding_free": trainer.padding_free,
        "activation_checkpointing": trainer.model.is_activation_checkpointing, "bf16": config.bf16,
        "precompute_ref_log_probs": config.precompute_ref_log_probs, "optim": str(config.optim),
        "reference": type(trainer.ref_model).__name__, "pairs": len(trainer.train_dataset),
        "attn_implementation": trainer.model.config._attn_implementation})


if __name__ == "__main__":
    main()
