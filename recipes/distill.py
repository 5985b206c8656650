#!/usr/bin/env python
"""Knowledge distillation (logit KD: forward / reverse KL, generalized JSD) of a causal LM student on a teacher,
with DDP, FSDP or FSDP2, on GPUs (NCCL) or CPU (gloo).

    torchrun --nproc_per_node=N recipes/distill.py --config configs/demo-distill.yaml [key.sub=value ...]
    python recipes/distill.py --help-config                     # every key (finetune's plus distill.*)

What is this recipe's own: the distill: section, the teacher and the objective (llmtrain.distill, the math in
llmtrain.losses.distill) and eval; the rest is llmtrain.train's (llmtrain/train/recipe.py).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout, installed or not

from llmtrain import data, distill, distributed
from llmtrain.train.recipe import Recipe

USAGE = """\
Knowledge distillation of a student (model.path, or an inline model.config) on a teacher (distill.teacher_path)
with DDP, FSDP or FSDP2 on GPUs (NCCL) or CPUs (gloo).

  torchrun --nproc_per_node=N recipes/distill.py --config configs/demo-distill.yaml [key.sub=value ...]

The data are finetune's (text, instruction, chat) with its masks: the loss is taken on the tokens SFT trains.
Per trained token: distill.kd_weight x the divergence of the student's next-token distribution from the
teacher's (distill.loss: forward_kl, reverse_kl or jsd with distill.jsd_beta; at distill.temperature; over the
teacher's distill.top_k ids and a bucket for the rest, or the whole vocabulary) + (1 - distill.kd_weight) x the
student's cross-entropy on the labels. Neither model's [tokens x vocab] logits exist: both are taken a chunk of
tokens at a time (docs/distill.md). Teacher and student must share the tokenizer's vocabulary.

Writes to output_dir what recipes/finetune.py writes; metrics.jsonl adds kd_loss and ce_loss (per trained
token); with eval.every_steps, val_loss (the student's cross-entropy), val_kd_loss and val_teacher_loss.
"""


class Distill(Recipe):
    config_cls = distill.DistillConfig
    usage = USAGE

    def check(self, cfg: distill.DistillConfig) -> None:
        distill.check(cfg)

    def setup(self, run, built) -> None:
        super().setup(run, built)
        section = run.cfg.distill
        self.val = built.val
        self.teacher = distill.Teacher(run, section)
        run.metrics.info(self.teacher.describe(section))
        self.objective = distill.KDObjective(run.token_loss, self.teacher, section, len(run.tokenizer))

    def evaluate(self, at_step: int) -> dict:
        run, cfg = self.run, self.run.cfg
        batches = data.eval_batches(self.val, cfg.train.micro_batch_size, run.env.world_size, run.env.rank,
                                    cfg.eval.max_batches)
        return self.objective.evaluate(run.model, batches, run.env.device, run.autocast)


if __name__ == "__main__":
    distributed.hard_exit(Distill().main())
