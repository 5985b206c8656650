"""Knowledge distillation (recipes/distill.py): the distill: config section, its set-up checks (before any process
group), the teacher (a frozen model from distill.teacher_path next to the student, sharded like DPO's reference)
and the objective: the token-weighted KD + CE sums of llmtrain.losses.distill over the trained tokens, with no
[tokens x vocab] logits of either model; its eval adds the KD and the teacher's loss. The data and the rest are
supervised fine-tuning's (llmtrain/recipes/sft.py) and the shared body's (llmtrain/recipes/base.py).

How the two forwards meet: the student's forward hands the final hidden states of its trained positions to
the step (TokenLoss's hook on its output layer, so that FSDP holds that layer gathered); there, the teacher's
forward runs on the same batch under no_grad with the same hook, and inside it, with both output layers
gathered, llmtrain.losses.distill.chunked_kd takes chunk after chunk of both models' logits. The teacher's
forward returns nothing differentiable (no FSDP backward hook of the teacher ever fires)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from llmtrain import distributed
from llmtrain.config import Config, ConfigError, ModelConfig, ranged
from llmtrain.losses import distill as kd
from llmtrain.losses.token import TokenLoss, trained_tokens
from llmtrain.models import hf
from llmtrain.models.build import BuiltModel, build_model
from llmtrain.recipes.sft import Finetune
from llmtrain.train.build import Run
from llmtrain.train.step import Share
from llmtrain.utils import DTYPES

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
METRICS = ("kd_loss", "ce_loss")  # per trained token, beside the logged loss (their kd_weight mix)


@dataclass
class DistillSection:
    teacher_path: str | None = None
    """The teacher: a Hugging Face model directory whose tokenizer has the student's vocabulary (a larger,
    padded embedding on either side is fine). Loaded frozen and sharded like the student (FSDP: FSDP2)."""
    teacher_dtype: Literal["match", "fp32", "bf16"] = "match"
    """The dtype the teacher computes in; match: parallel.mixed_precision's."""
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    """forward_kl: KL(teacher || student) | reverse_kl: KL(student || teacher) | jsd: generalized
    Jensen-Shannon with distill.jsd_beta (GKD; TRL's generalized_jsd_loss)."""
    jsd_beta: float = ranged("(0, 1)", default=0.5)
    """jsd: the teacher's weight in the mixture (TRL's beta; its 0 and 1 are forward_kl and reverse_kl)."""
    temperature: float = ranged("(0, inf)", default=1.0)
    """Divides both models' logits before the KD term (not the CE term); the loss is not scaled by T²."""
    kd_weight: float = ranged("[0, 1]", default=1.0)
    """loss = kd_weight x KD + (1 - kd_weight) x the student's cross-entropy on the labels; 1: pure KD."""
    top_k: int = ranged("[0, inf)", default=0)
    """> 0: the teacher's k most likely ids per token, every other id lumped into one bucket (the divergence of
    the (k+1)-way distributions); 0: the whole vocabulary."""


@dataclass
class DistillConfig(Config):
    """recipes/distill.py's Config: the shared sections plus distill:."""
    distill: DistillSection = field(default_factory=DistillSection)


def check(cfg: DistillConfig) -> None:
    """Before any process group: the teacher directory, its vocabulary against the student's tokenizer,
    distill.top_k against it, and the loss path."""
    d = cfg.distill
    if d.teacher_path is None:
        raise ConfigError("distill.teacher_path: not set; name the teacher's Hugging Face model directory")
    teacher = Path(d.teacher_path)
    if not teacher.is_dir():
        raise ConfigError(f"distill.teacher_path: no such directory: {d.teacher_path} (configs/demo-distill.yaml's "
                          "teacher is the SFT demo's export: run torchrun --standalone --nproc_per_node=2 "
                          "recipes/finetune.py --config configs/demo.yaml first)")
    if not (teacher / "config.json").is_file():
        raise ConfigError(f"distill.teacher_path: {d.teacher_path} has no config.json (not a Hugging Face model "
                          "directory)")
    try:
        hf.check_causal_lm(d.teacher_path)
        hf.check_not_quantized(d.teacher_path)
        hf.check_weights(teacher)
    except ConfigError as e:
        raise ConfigError(str(e).replace("model.path", "distill.teacher_path", 1)) from None
    if cfg.train.loss_impl != "chunked":
        raise ConfigError(f"train.loss_impl: recipes/distill.py computes its loss chunked (llmtrain.losses.distill)"
                          f"; set train.loss_impl=chunked, not {cfg.train.loss_impl}")
    student_tok = hf.load_tokenizer(cfg.tokenizer.path or cfg.model.path, cfg.model.trust_remote_code)
    teacher_tok = hf.load_tokenizer(d.teacher_path, cfg.model.trust_remote_code)
    check_vocab(student_tok, teacher_tok, d.teacher_path)
    if d.top_k >= len(student_tok):
        raise ConfigError(f"distill.top_k: {d.top_k} is not below the vocabulary's {len(student_tok)} ids; use a "
                          "smaller k, or 0 for the whole vocabulary")
    teacher_config = hf.load_model_config(ModelConfig(path=d.teacher_path), teacher_tok)
    hf.check_seq_len(teacher_config, cfg.data.seq_len)


def check_vocab(student_tok, teacher_tok, teacher_path: str) -> None:
    """Teacher and student share one vocabulary: the same number of ids with the same token strings (the
    models' embeddings may be padded beyond it: the KD compares the first len(tokenizer) ids)."""
    n_student, n_teacher = len(student_tok), len(teacher_tok)
    if n_student != n_teacher:
        raise ConfigError(f"distill.teacher_path: the teacher's tokenizer ({teacher_path}) has {n_teacher} tokens, "
                          f"the student's {n_student}: distillation needs one vocabulary (padding beyond it is fine)")
    ids = range(n_student)
    for i, (a, b) in enumerate(zip(student_tok.convert_ids_to_tokens(ids), teacher_tok.convert_ids_to_tokens(ids))):
        if a != b:
            raise ConfigError(f"distill.teacher_path: token id {i} is {b!r} in the teacher's tokenizer "
                              f"({teacher_path}) but {a!r} in the student's: distillation needs one vocabulary")


class Teacher:
    """The frozen teacher beside the student: `run(batch, on_hidden)` runs its forward (no_grad, its own
    compute dtype) and calls on_hidden(final hidden states of the trained positions) inside it."""

    def __init__(self, run: Run, section: DistillSection):
        cfg, env = run.cfg, run.env
        tokenizer = hf.load_tokenizer(section.teacher_path, cfg.model.trust_remote_code)
        source = ModelConfig(path=section.teacher_path, attn_implementation=cfg.model.attn_implementation)
        config = hf.load_model_config(source, tokenizer)
        dtype = DTYPES[cfg.parallel.mixed_precision if section.teacher_dtype == "match" else section.teacher_dtype]
        self.built: BuiltModel = build_model(source, config, cfg.parallel, env, cfg.train.seed,
                                             frozen_next_to=run.policy, frozen_dtype=dtype)
        self.device = env.device
        self.token_loss = TokenLoss("chunked", self.built.model, env.device, cfg.train.loss_chunk_tokens)  # collective

    def autocast(self):
        plan = self.built.plan
        # Explicitly on or off: it runs inside the student's forward, whose autocast it must not inherit.
        return torch.autocast(self.device.type, dtype=plan.dtype, enabled=plan.autocast)

    def run(self, batch: dict, on_hidden) -> None:
        def inside(hidden, _targets):
            on_hidden(hidden)
            return hidden.new_zeros(())  # nothing differentiable leaves the teacher's forward

        with torch.no_grad(), self.autocast():
            self.token_loss.on_trained_rows(self.built.model, batch, inside)

    def describe(self, section: DistillSection) -> str:
        b = self.built
        return (f"distill: teacher {section.teacher_path} ({b.n_params / 1e6:.2f}M parameters, frozen, "
                f"{b.plan.strategy.name}, computes in {str(b.plan.dtype).removeprefix('torch.')}) | loss "
                f"{section.loss}" + (f" beta {section.jsd_beta:g}" if section.loss == "jsd" else "")
                + f" | temperature {section.temperature:g} | kd_weight {section.kd_weight:g} | top_k "
                f"{section.top_k or 'all'}")


class KDObjective:
    """The step's objective: Σ over trained tokens of kd_weight·KD + (1 - kd_weight)·CE / the global count of
    trained tokens (an llmtrain.train.step.Objective)."""

    def __init__(self, student: TokenLoss, teacher: Teacher, section: DistillSection, vocab: int):
        self.student, self.teacher, self.top_k = student, teacher, section.top_k
        self.params = kd.KDParams(vocab, kd.jsd_beta(section.loss, section.jsd_beta), section.temperature,
                                  section.kd_weight)

    def sums(self, model: torch.nn.Module, batch: dict) -> kd.KDSums:
        """One micro-batch's sums: the student's forward, and the teacher's inside it."""
        student, teacher, out = self.student, self.teacher, []
        grad = torch.is_grad_enabled()  # off in eval: the teacher's no_grad must not turn it on again

        def on_student(hidden, targets):
            device = hidden.device.type
            student_autocast = (torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
            leaves = student.head_inputs(hidden) if grad else []

            def student_logits(h):
                with torch.autocast(device, dtype=student_autocast[0], enabled=student_autocast[1]):
                    return student.head_logits(h)

            def on_teacher(teacher_hidden):
                def teacher_dist(rows):
                    with torch.no_grad(), teacher.autocast():
                        logits = teacher.token_loss.head_logits(teacher_hidden[rows])
                    return kd.teacher_dist(logits, self.params.vocab, self.params.temperature, self.top_k)

                with torch.set_grad_enabled(grad):
                    out.append(kd.chunked_kd(student_logits, hidden, targets, teacher_dist, self.params,
                                             student.chunk_tokens, leaves))

            teacher.run(batch, on_teacher)
            return out[0].loss

        student.on_trained_rows(model, batch, on_student)
        return out[0]

    def counts(self, batch: dict) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.long, device=batch["labels"].device)

    def share(self, model: torch.nn.Module, batch: dict, totals: torch.Tensor) -> Share:
        sums = self.sums(model, batch)
        return Share(sums.loss / totals[0].clamp(min=1), torch.stack([sums.loss.detach(), sums.kd, sums.ce]))

    def report(self, metrics: torch.Tensor, totals: torch.Tensor) -> tuple[float, dict]:
        n = max(int(totals[0]), 1)
        loss, *parts = (v / n for v in metrics.tolist())
        return loss, dict(zip(METRICS, parts))

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, batches, device: torch.device, autocast) -> dict[str, float]:
        """Over every rank's validation batches, per trained token: val_loss (the student's cross-entropy, as
        finetune's val_loss), val_kd_loss, val_teacher_loss (the teacher's cross-entropy: where val_loss heads).
        Collective: every rank passes as many batches."""
        was_training = model.training
        model.eval()
        totals = torch.zeros(4, dtype=torch.float64, device=device)
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            with autocast():
                sums = self.sums(model, batch)
            with self.teacher.autocast():
                teacher_ce = self.teacher.token_loss.loss_sum(self.teacher.built.model, batch)
            totals += torch.stack([sums.ce, sums.kd, teacher_ce, trained_tokens(batch["labels"])]).double()
        distributed.all_reduce(totals)
        model.train(was_training)
        n = totals[3].clamp(min=1)
        return {"val_loss": (totals[0] / n).item(), "val_kd_loss": (totals[1] / n).item(),
                "val_teacher_loss": (totals[2] / n).item()}


class Distill(Finetune):
    name = "distill"
    config_cls = DistillConfig
    usage = USAGE

    def check(self, cfg: DistillConfig) -> None:
        check(cfg)

    def setup(self, run, built) -> None:
        super().setup(run, built)
        section = run.cfg.distill
        self.teacher = Teacher(run, section)
        run.metrics.info(self.teacher.describe(section))
        self.objective = KDObjective(run.token_loss, self.teacher, section, len(run.tokenizer))

    def evaluate(self, at_step: int) -> dict:
        return self.objective.evaluate(self.run.model, self.val_batches(), self.run.env.device, self.run.autocast)
