"""The comparison point of bench/run.py's "vs TRL" benchmark: TRL's SFTTrainer, what most Hugging Face users
fine-tune with, on the same chat data, tokenizer, model shape, micro-batch and ranks as the recipe, with
TRL's packing (best-fit decreasing, padding-free rows with position_ids) and assistant-only loss on; TRL
defaults otherwise. Runs in its own virtual environment (TRL is no dependency of llmtrain): bench/run.py
creates it with `python3 -m venv` + `pip install torch==2.13.0 trl==1.16.0 transformers==5.24.0` unless
--trl-python names one.

    torchrun --standalone --nproc_per_node=2 bench/baselines/trl_sft.py --config bench/configs/llama-32k.yaml \
        --data data/demo/chat.jsonl --steps 20 --warmup 8 --output-dir DIR --out result.json

Counting, timing and the output JSON are bench/baselines/hf_trainer.py's (trained tokens: label positions that carry
a loss after the shift; rank 0 times each optimizer step).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trl
import yaml
from datasets import load_dataset
from trl import SFTConfig, SFTTrainer

from hf_trainer import Counting, build_model, load_tokenizer, parse_args, train_and_report, training_kwargs


class CountingSFTTrainer(Counting, SFTTrainer):
    pass


def main() -> None:
    args = parse_args(__doc__)
    cfg = yaml.safe_load(open(args.config))
    tok = load_tokenizer(cfg)
    sft = SFTConfig(**training_kwargs(cfg, args), max_length=cfg["data"]["seq_len"], packing=True,
                    assistant_only_loss=True, dataset_num_proc=1)
    ds = load_dataset("json", data_files=args.data, split="train")
    trainer = CountingSFTTrainer(model=build_model(cfg, tok), args=sft, train_dataset=ds, processing_class=tok)
    train_and_report(trainer, args, {"trl": trl.__version__, "packing_strategy": sft.packing_strategy,
                                     "padding_free": sft.padding_free,
                                     "attn_implementation": trainer.model.config._attn_implementation})


if __name__ == "__main__":
    main()
