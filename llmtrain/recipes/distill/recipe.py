"""Knowledge distillation (recipes/distill.py): a Finetune (its data, its micro-batches) whose objective is
KDObjective (llmtrain.recipes.distill.objective) against a teacher side (llmtrain.recipes.distill.teacher): the
teacher model beside the student (llmtrain.train.frozen) or its stored top-k log-probs (distill.teacher_logits,
written by python -m llmtrain.tools.distill_precompute); its eval adds the KD and the teacher's loss. Its config
and set-up checks: llmtrain.recipes.distill.config.

On-policy distillation (GKD, distill.on_policy_fraction) is a batch source too, llmtrain.rollout.on_policy's
OnPolicySource: on the steps it picks, the student completes each data row's prompt (the rollout: section's
engine; the local one keys each sample) and the same objective trains on those rows."""

from __future__ import annotations

from llmtrain.losses import distill as kd
from llmtrain.recipes.distill import teacher as teacher_side
from llmtrain.recipes.distill.config import USAGE, DistillConfig, DistillSection, check, teacher_dtype
from llmtrain.recipes.distill.objective import KDObjective
from llmtrain.recipes.distill.teacher import LiveTeacher, StoredSource, StoredTeacher
from llmtrain.recipes.sft import Finetune
from llmtrain.rollout.engine import Sampling
from llmtrain.rollout.on_policy import OnPolicySource
from llmtrain.rollout.registry import build as build_rollout
from llmtrain.rollout.rows import trainer_logps
from llmtrain.train.build import Run
from llmtrain.utils import DTYPES


def describe_loss(section: DistillSection) -> str:
    return (f"loss {section.loss}" + (f" beta {section.jsd_beta:g}" if section.loss == "jsd" else "")
            + f" | temperature {section.temperature:g} | kd_weight {section.kd_weight:g} | top_k "
            f"{section.top_k or 'all'}")


class Distill(Finetune):
    name = "distill"
    config_cls = DistillConfig
    usage = USAGE
    sequence_parallel = True  # the teacher's forward splits as the student's; stored top-k values are sliced

    def check(self, cfg: DistillConfig) -> None:
        check(cfg)

    def source(self, run: Run):
        built, source = super().source(run)
        d = run.cfg.distill
        if d.teacher_logits is not None:
            manifest = teacher_side.read_manifest(d.teacher_logits)  # checked before the process group (check_stored)
            return built, StoredSource(source, teacher_side.Store(d.teacher_logits, manifest))
        if d.on_policy_fraction == 0:
            return built, source
        cfg = run.cfg
        rollout = build_rollout(cfg.rollout, run, cfg.data.seq_len + d.max_new_tokens,
                                cfg.train.micro_batch_size * cfg.train.grad_accum_steps)
        run.metrics.info(f"distill: on-policy on a {d.on_policy_fraction:g} share of the steps: the student "
                         f"completes each row's prompt (rollout.engine={cfg.rollout.engine}, up to {d.max_new_tokens} "
                         f"tokens at temperature {d.sampling_temperature:g}, EOS ids {rollout.eos_ids}) and learns "
                         "the teacher's distributions on it")
        return built, OnPolicySource(source, rollout, Sampling(d.max_new_tokens, d.sampling_temperature),
                                     d.on_policy_fraction, cfg.train.seed, run.state, cfg.train.micro_batch_size,
                                     run.env.device, lambda micro: trainer_logps(
                                         run.token_loss, run.model, run.autocast, micro, d.sampling_temperature))

    def setup(self, run, built) -> None:
        super().setup(run, built)
        section = run.cfg.distill
        if section.teacher_logits is None:
            self.teacher = LiveTeacher.beside_student(run, section.teacher_path, DTYPES[teacher_dtype(run.cfg)],
                                                      section.temperature, section.top_k)
            run.metrics.info(f"{self.teacher.describe(section.teacher_path)} | {describe_loss(section)}")
        else:
            self.teacher = StoredTeacher()
            run.metrics.info(f"distill: offline teacher {section.teacher_logits} (its top-{section.top_k} "
                             f"log-probs; no teacher model, eval: val_loss only) | {describe_loss(section)}")
        params = kd.KDParams(len(run.tokenizer), kd.jsd_beta(section.loss, section.jsd_beta), section.temperature,
                             section.kd_weight)
        self.objective = KDObjective(run.token_loss, self.teacher, params)

    def evaluate(self, at_step: int) -> dict:
        if not self.teacher.evaluates:  # the stored teacher: the student's own validation loss (finetune's)
            return super().evaluate(at_step)
        return self.objective.evaluate(self.run.model, self.val_batches(), self.run.env.device, self.run.autocast)
