#!/usr/bin/env python
"""Fine-tune a Llama-style causal LM with DDP, FSDP (FSDP1) or FSDP2, on GPUs (NCCL) or CPU (gloo).

    torchrun --nproc_per_node=N recipes/finetune.py --config configs/demo.yaml [key.sub=value ...]
    python recipes/finetune.py --config configs/demo.yaml           # one process, same code path
    python recipes/finetune.py --help-config                        # every key, type, default

What is this recipe's own: its objective (the token-weighted cross-entropy) and its eval (validation loss);
the rest is llmtrain.train's (llmtrain/train/recipe.py).
"""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout, installed or not

from llmtrain import data, distributed
from llmtrain.losses import token as loss_lib
from llmtrain.train.recipe import Recipe
from llmtrain.train.step import TokenObjective

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


class Finetune(Recipe):
    usage = USAGE

    def setup(self, run, built):
        super().setup(run, built)
        self.val = built.val
        self.objective = TokenObjective(run.token_loss)

    def evaluate(self, at_step: int) -> dict:
        run, cfg = self.run, self.run.cfg
        batches = data.eval_batches(self.val, cfg.train.micro_batch_size, run.env.world_size, run.env.rank,
                                    cfg.eval.max_batches)
        val_loss, _ = loss_lib.evaluate(run.model, batches, run.env.device, run.autocast, run.token_loss)
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}


if __name__ == "__main__":
    distributed.hard_exit(Finetune().main())
