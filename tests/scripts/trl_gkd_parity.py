"""llmtrain's chunked KD (llmtrain.losses.distill) against TRL's GKDTrainer.generalized_jsd_loss, on the same
logits.

TRL is a dev-only comparison, kept out of llmtrain's environment; run this with a Python that has trl
installed (TRL 1.16.0 was checked: a plain venv with pip install torch==2.13.0 trl==1.16.0), from the repo root:

    PYTHONPATH=. /path/to/trl-venv/bin/python tests/scripts/trl_gkd_parity.py

Both sides get the same student and teacher logits [rows x positions x vocab] and labels with ignored
positions (-100). TRL takes them whole (reduction batchmean: the mean over unmasked positions); llmtrain takes
the unmasked positions' rows a chunk at a time (the student's "output layer" is the identity here, so its
hidden states are its logits) and returns a sum, divided here by the same count. Prints, per loss (TRL's beta
0, 0.5, 0.9 and 1) x temperature, both losses and the largest |difference| of the loss and of the gradient
w.r.t. the student's logits; exits non-zero above 1e-5. TRL has no top-k teacher: top_k is not compared here
(tests/distill/test_distill_loss.py checks it against a full-logits computation)."""

from __future__ import annotations

import sys

import torch
from trl.experimental.gkd import GKDTrainer

from llmtrain.losses import distill as kd

ROWS, POSITIONS, VOCAB, CHUNK = 3, 11, 50, 7
TOL = 1e-5


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(ROWS, POSITIONS, VOCAB, generator=g) * 2
    teacher = torch.randn(ROWS, POSITIONS, VOCAB, generator=g) * 3
    labels = torch.randint(0, VOCAB, (ROWS, POSITIONS), generator=g)
    labels[0, :4] = -100  # a prompt
    labels[2, 8:] = -100  # padding
    return student, teacher, labels


def trl(student, teacher, labels, beta, temperature):
    s = student.clone().requires_grad_()
    loss = GKDTrainer.generalized_jsd_loss(s, teacher, labels, beta=beta, temperature=temperature)
    return loss.item(), torch.autograd.grad(loss, s)[0]


def ours(student, teacher, labels, loss, beta, temperature):
    keep = labels != -100
    s = student.clone().requires_grad_()
    hidden, flat_teacher, targets = s[keep], teacher[keep], labels[keep]
    params = kd.KDParams(VOCAB, kd.jsd_beta(loss, beta), temperature, kd_weight=1.0)
    sums = kd.chunked_kd(lambda h: h, hidden, targets,
                         lambda rows: kd.teacher_dist(flat_teacher[rows], VOCAB, temperature, 0), params, CHUNK, [])
    out = sums.loss / keep.sum()
    return out.item(), torch.autograd.grad(out, s)[0]


def main() -> int:
    student, teacher, labels = inputs()
    worst = 0.0
    cases = [("forward_kl", 0.0), ("jsd", 0.5), ("jsd", 0.9), ("reverse_kl", 1.0)]
    for (loss, beta) in cases:
        for temperature in (1.0, 0.5, 2.0):
            want, want_grad = trl(student, teacher, labels, beta, temperature)
            got, got_grad = ours(student, teacher, labels, loss, beta, temperature)
            diff = max(abs(got - want), (got_grad - want_grad).abs().max().item())
            worst = max(worst, diff)
            print(f"{loss:10s} beta {beta:<4g} T {temperature:<4g} TRL {want:.7f} llmtrain {got:.7f} "
                  f"max |diff| (loss, grad) {diff:.2e}")
    print(f"largest difference {worst:.2e} ({'ok' if worst <= TOL else 'ABOVE'} {TOL:g})")
    return 0 if worst <= TOL else 1


if __name__ == "__main__":
    sys.exit(main())
