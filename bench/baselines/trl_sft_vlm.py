"""The comparison point of bench/run.py's `vlm` benchmark: TRL's SFTTrainer on image chat data (its
DataCollatorForVisionLanguageModeling, assistant_only_loss=True), with the same model directory, processor,
records, micro-batch, ranks and frozen vision tower as the recipe, fp32; TRL defaults otherwise, except two that
TRL changes from TrainingArguments and that would make the comparison unequal: gradient checkpointing and bf16 (on
a CPU, bf16 matmuls are emulated), both on in TRL, off here as in the recipe. Runs in TRL's own virtual environment
(bench/run.py --trl-venv).

    torchrun --standalone --nproc_per_node=2 bench/baselines/trl_sft_vlm.py --config CONFIG.yaml \
        --data data/demo/vlm/train.jsonl --steps 20 --warmup 5 --output-dir DIR --out result.json

Counting, timing and the output JSON are bench/baselines/hf_trainer.py's (trained tokens: label positions that
carry a loss after the shift; rank 0 times each optimizer step).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import trl
import yaml
from datasets import Image, List, load_dataset
from transformers import AutoModelForImageTextToText, AutoProcessor
from trl import SFTConfig

from hf_trainer import parse_args, train_and_report, training_kwargs
from trl_sft import CountingSFTTrainer


def main() -> None:
    args = parse_args(__doc__)
    cfg = yaml.safe_load(open(args.config))
    path = cfg["model"]["path"]
    processor = AutoProcessor.from_pretrained(path, trust_remote_code=True)
    processor.tokenizer.padding_side = "right"
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    merger = {id(p) for p in model.model.visual.merger.parameters()}
    for p in model.model.visual.parameters():  # the recipe's default: the tower frozen, its merger trained
        p.requires_grad_(id(p) in merger)
    folder = Path(args.data).resolve().parent
    ds = load_dataset("json", data_files=args.data, split="train")
    ds = ds.map(lambda r: {"images": [str(folder / p) for p in r["images"]]}).cast_column("images", List(Image()))
    sft = SFTConfig(**training_kwargs(cfg, args), max_length=cfg["data"]["seq_len"], assistant_only_loss=True,
                    dataset_num_proc=1, gradient_checkpointing=False, bf16=False)
    trainer = CountingSFTTrainer(model=model, args=sft, train_dataset=ds, processing_class=processor)
    train_and_report(trainer, args, {"trl": trl.__version__, "gradient_checkpointing": sft.gradient_checkpointing,
                                     "bf16": sft.bf16, "optim": str(sft.optim),
                                     "attn_implementation": trainer.model.config._attn_implementation})


if __name__ == "__main__":
    main()
