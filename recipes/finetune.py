#!/usr/bin/env python
"""Fine-tune a Llama-style causal LM with DDP, FSDP (FSDP1) or FSDP2, on GPUs (NCCL) or CPU (gloo).

    torchrun --nproc_per_node=N recipes/finetune.py --config configs/demo.yaml [key.sub=value ...]
    python recipes/finetune.py --config configs/demo.yaml           # one process, same code path
    python recipes/finetune.py --help-config                        # every key, type, default

The shared body (command line, model, optimizer, checkpoints, loop, export) is llmtrain.train; what is
this recipe's own is its step (token cross-entropy, llmtrain.step) and its eval (validation loss).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout, installed or not

import torch  # noqa: E402

from llmtrain import data, distributed, parallelize, train as trainer  # noqa: E402
from llmtrain.losses import token as loss_lib  # noqa: E402
from llmtrain.config import Config, ConfigError  # noqa: E402
from llmtrain.step import train_step  # noqa: E402


USAGE = """\
Fine-tune a Llama-style causal LM with DDP, FSDP or FSDP2 on GPUs (NCCL) or CPUs (gloo).

  torchrun --nproc_per_node=N recipes/finetune.py --config configs/demo.yaml [key.sub=value ...]
  python recipes/finetune.py --config configs/demo.yaml parallel.strategy=none   # one process

Settings come from the YAML file, then from dotted overrides (train.lr=1e-4 log.tensorboard=true);
--help-config lists every key. configs/ holds ready-made files for common jobs.

Writes to output_dir: metrics.jsonl (one record per logged step), config.yaml, checkpoints/
(checkpoint.every_steps; a rerun resumes), hf/ (the Hugging Face export), tensorboard/, wandb/.
Then: python -m llmtrain.plot OUTPUT_DIR          loss / lr / throughput curves as a PNG
      python -m llmtrain.generate --model OUTPUT_DIR/hf --prompt "..." [--chat]
      python -m llmtrain.convert OUTPUT_DIR/checkpoints/step_N OUT    checkpoint -> HF export
"""


def train(cfg: Config, env: distributed.DistEnv) -> torch.nn.Module:
    """Train (resuming if asked) and export; returns the trained (wrapped) model."""
    run = trainer.build(cfg, env)
    built, steps = trainer.data_steps(run)

    def step(batches: list[dict]) -> trainer.StepResult:
        return train_step(run.model, run.plan, batches, run.opt, run.scaler, cfg.train.max_grad_norm, env.device,
                          env.world_size, run.token_loss)

    def evaluate(at_step: int) -> None:
        batches = data.eval_batches(built.val, cfg.train.micro_batch_size, env.world_size, env.rank,
                                    cfg.eval.max_batches)
        val_loss, _ = loss_lib.evaluate(run.model, batches, env.device,
                                        lambda: parallelize.autocast(run.plan, env.device), run.token_loss)
        run.metrics.log({"step": at_step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))})

    return trainer.loop(run, steps, step, evaluate)


def check(cfg: Config) -> None:
    if "preference" in {s.format for s in cfg.data.sources or []} | {cfg.data.format}:
        raise ConfigError("data.format=preference: pairs train with recipes/dpo.py, not recipes/finetune.py")


def main(argv: list[str] | None = None) -> int:
    return trainer.main(argv, USAGE, Config, train, check)


if __name__ == "__main__":
    distributed.hard_exit(main())
