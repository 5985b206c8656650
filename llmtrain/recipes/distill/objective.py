"""Distillation's objective (llmtrain.recipes.distill.recipe): per micro-batch, the student's forward hands the final
hidden states of its trained positions to the step (TokenLoss's hook on its output layer, so that FSDP holds that
layer gathered); there the teacher side (llmtrain.recipes.distill.teacher) gives the teacher's distributions of
the same tokens (the teacher model's forward runs on the same batch under no_grad with the same hook), and
llmtrain.losses.distill.chunked_kd takes chunk after chunk of both models' logits: the token-weighted KD + CE sums,
with no [tokens x vocab] logits of either model. The teacher's forward returns nothing differentiable (no FSDP
backward hook of the teacher ever fires)."""

from __future__ import annotations

import torch

from llmtrain.losses import distill as kd
from llmtrain.losses.token import TokenLoss, trained_tokens, validation_sums
from llmtrain.recipes.distill.teacher import TeacherDist, TeacherSide
from llmtrain.train.step import Share

METRICS = ("kd_loss", "ce_loss")  # per trained token, beside the logged loss (their kd_weight mix)


class KDObjective:
    """The step's objective: Σ over trained tokens of kd_weight·KD + (1 - kd_weight)·CE / the global count of
    trained tokens (an llmtrain.train.step.Objective)."""

    def __init__(self, student: TokenLoss, teacher: TeacherSide, params: kd.KDParams):
        self.student, self.teacher, self.params = student, teacher, params

    def sums(self, model: torch.nn.Module, batch: dict) -> kd.KDSums:
        """One micro-batch's sums: the student's forward, and the teacher's dists inside it."""
        student, out = self.student, []
        grad = torch.is_grad_enabled()  # off in eval: the teacher's no_grad must not turn it on again

        def on_student(hidden, targets):
            device = hidden.device.type
            student_autocast = (torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
            leaves = student.head_inputs(hidden) if grad else []

            def student_logits(h):
                with torch.autocast(device, dtype=student_autocast[0], enabled=student_autocast[1]):
                    return student.head_logits(h)

            def on_teacher(teacher_dist: TeacherDist):
                with torch.set_grad_enabled(grad):
                    out.append(kd.chunked_kd(student_logits, hidden, targets, teacher_dist, self.params,
                                             student.chunk_tokens, leaves))

            self.teacher.dists(batch, on_teacher)
            return out[0].loss

        student.on_trained_rows(model, batch, on_student)
        return kd.KDSums(*student.whole(torch.stack(out[0])).unbind())  # a sequence split's slice -> the whole rows

    def counts(self, batch: dict) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.long, device=batch["labels"].device)

    def share(self, model: torch.nn.Module, batch: dict, totals: torch.Tensor) -> Share:
        sums = self.sums(model, batch)
        return Share(sums.loss / totals[0].clamp(min=1), torch.stack([sums.loss.detach(), sums.kd, sums.ce]))

    def report(self, metrics: torch.Tensor, totals: torch.Tensor) -> tuple[float, dict]:
        n = max(int(totals[0]), 1)
        loss, *parts = (v / n for v in metrics.tolist())
        return loss, dict(zip(METRICS, parts))

    def evaluate(self, model: torch.nn.Module, batches, device: torch.device, autocast) -> dict[str, float]:
        """Over every rank's validation batches, per trained token: val_loss (the student's cross-entropy, as
        finetune's val_loss), val_kd_loss, val_teacher_loss (the teacher's cross-entropy: where val_loss heads).
        Collective: every rank passes as many batches. The teacher model's (LiveTeacher) only."""
        def sums(batch: dict) -> torch.Tensor:
            with autocast():
                student = self.sums(model, batch)
            teacher_ce = self.teacher.frozen.forward(lambda teacher, token_loss: token_loss.loss_sum(teacher, batch))
            return torch.stack([student.ce, student.kd, teacher_ce, trained_tokens(batch["labels"])])
        totals = validation_sums(model, batches, device, 4, sums, self.student.sp_group)
        n = totals[3].clamp(min=1)
        return {"val_loss": (totals[0] / n).item(), "val_kd_loss": (totals[1] / n).item(),
                "val_teacher_loss": (totals[2] / n).item()}
