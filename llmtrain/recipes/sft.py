"""Supervised fine-tuning (recipes/finetune.py): the token-weighted cross-entropy over token rows, and the
validation loss as its eval. The rest is the shared body's (llmtrain/recipes/base.py)."""

from __future__ import annotations

import math

import torch
from torch import nn

from llmtrain import data
from llmtrain.losses import token as loss_lib
from llmtrain.recipes.base import Recipe
from llmtrain.train.step import Share

USAGE = """\
Fine-tune a Llama-style causal LM with DDP, FSDP or FSDP2 on GPUs (NCCL) or CPUs (gloo).

  torchrun --nproc_per_node=N recipes/finetune.py --config configs/demo.yaml [key.sub=value ...]
  python recipes/finetune.py --config configs/demo.yaml parallel.strategy=none   # one process

Settings come from the YAML file, then from dotted overrides (train.lr=1e-4 log.tensorboard=true);
--help-config lists every key. configs/ holds ready-made files for common jobs.

Writes to output_dir: metrics.jsonl (one record per logged step), config.yaml, checkpoints/
(checkpoint.every_steps; a rerun resumes), hf/ (the Hugging Face export), tensorboard/, wandb/.
Then: python -m llmtrain.plot OUTPUT_DIR          loss / lr / throughput curves as a PNG
      python -m llmtrain.tools.generate --model OUTPUT_DIR/hf --prompt "..." [--chat]
      python -m llmtrain.convert OUTPUT_DIR/checkpoints/step_N OUT    checkpoint -> HF export
"""


class TokenObjective:
    """Supervised fine-tuning's objective: the token-weighted cross-entropy, Σ token losses / global trained
    tokens, through the recipe's TokenLoss (chunked, full or liger)."""

    def __init__(self, token_loss):
        self.token_loss = token_loss

    def counts(self, batch: dict) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.long, device=batch["labels"].device)

    def share(self, model: nn.Module, batch: dict, totals: torch.Tensor) -> Share:
        loss_sum = self.token_loss.loss_sum(model, batch)
        return Share(loss_sum / totals[0].clamp(min=1), loss_sum.detach().reshape(1))

    def report(self, metrics: torch.Tensor, totals: torch.Tensor) -> tuple[float, dict]:
        return metrics[0].item() / max(int(totals[0]), 1), {}


class Finetune(Recipe):
    name = "finetune"
    usage = USAGE
    sequence_parallel = True

    def setup(self, run, built):
        super().setup(run, built)
        self.val, self.collate = built.val, built.collate
        self.answers = run.processor is not None  # image chat rows: one example (question, answer) each
        self.objective = TokenObjective(run.token_loss)

    def val_batches(self):
        """This rank's share of the validation rows (every rank as many batches)."""
        run, cfg = self.run, self.run.cfg
        return data.eval_batches(self.val, cfg.train.micro_batch_size, run.env.dp_size, run.env.dp_rank,
                                 cfg.eval.max_batches, self.collate)

    def evaluate(self, at_step: int) -> dict:
        run = self.run
        val_loss, _ = loss_lib.evaluate(run.model, self.val_batches(), run.env.device, run.autocast, run.token_loss)
        out = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}
        if self.answers:  # the rows whose answer greedy decoding gives exactly (docs/vision.md)
            out["val_answer_accuracy"] = loss_lib.answer_accuracy(run.model, self.val_batches(), run.env.device,
                                                                  run.autocast, run.token_loss)
        return out
