"""The distillation tests' set-up (tests/distill/test_distill.py, test_distill_on_policy.py): the tiny reference
run's export as the teacher, a smaller inline student of the same tokenizer, the KD settings, and the per-token
divergence computed from whole logits as TRL writes it."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from helpers import REPO

DISTILL = REPO / "recipes" / "distill.py"
# initializer_range 0.5: a student far from the (nearly uniform, 4-step) teacher, so that the KD term is O(1)
STUDENT = ("model.config.hidden_size=16", "model.config.num_hidden_layers=1", "model.config.initializer_range=0.5")
BETA, TEMPERATURE, TOP_K, KD_WEIGHT = 0.3, 1.5, 8, 0.7
KD = ("distill.loss=jsd", f"distill.jsd_beta={BETA}", f"distill.top_k={TOP_K}", f"distill.kd_weight={KD_WEIGHT}",
      f"distill.temperature={TEMPERATURE}")


def distill_args(teacher: Path, *extra: str) -> list[str]:
    # Unpacked rows: transformers' own forward (the step-1 checks) would let packed documents see each other.
    return [f"distill.teacher_path={teacher}", "data.packing=false", *STUDENT, *KD, *extra]


def reference_kd(student_logits, teacher_logits, vocab, beta, temperature, top_k) -> torch.Tensor:
    """Per token, from whole logits, as TRL's generalized_jsd_loss writes it (F.kl_div), with the top-k bucket."""
    s = F.log_softmax(student_logits[:, :vocab] / temperature, -1)
    t = F.log_softmax(teacher_logits[:, :vocab] / temperature, -1)
    ids = t.topk(top_k, -1).indices
    inside = torch.zeros_like(t, dtype=torch.bool).scatter(1, ids, True)
    s, t = ([torch.cat([x.gather(1, ids), torch.log((x.exp() * ~inside).sum(-1, keepdim=True))], 1) for x in (s, t)])
    m = torch.logsumexp(torch.stack([s + torch.log(torch.tensor(1 - beta)), t + torch.log(torch.tensor(beta))]), 0)
    return (beta * F.kl_div(m, t, reduction="none", log_target=True)
            + (1 - beta) * F.kl_div(m, s, reduction="none", log_target=True)).sum(-1)


def seeded_student(export: Path):
    """The recipe's seeded init of an inline student (hf._random_init: train.seed 7), from its exported config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(7)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(export), dtype=torch.float32)
