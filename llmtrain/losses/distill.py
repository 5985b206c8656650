"""Knowledge distillation (logit KD) of a student on a teacher's next-token distributions, a chunk of tokens at
a time: neither model's [tokens x vocab] logits exist for more than one chunk.

Per trained token (the positions SFT trains: labels != IGNORE), with z_s, z_t the two models' logits over the
vocabulary they share (the tokenizer's V real ids: a padded embedding's extra rows on either side are dropped,
and each distribution is a softmax over those V ids), T the temperature:

    s = log_softmax(z_s / T),  t = log_softmax(z_t / T)
    forward_kl   KL(t || s) = Σ p_t (t - s)
    reverse_kl   KL(s || t) = Σ p_s (s - t)
    jsd          β KL(t || m) + (1 - β) KL(s || m),  m = β p_t + (1 - β) p_s      (GKD, Agarwal et al. 2024)

which is TRL's GKDTrainer.generalized_jsd_loss with its conventions (jsd at β = 0 is forward_kl, at β = 1
reverse_kl; the temperature divides both logits and the loss is not scaled by T²).

top_k > 0 keeps the teacher's k most likely ids per token and lumps every other id into one bucket: both
distributions become (k + 1)-way, p(id) for the k ids and p(rest) = 1 - Σ_k p(id) (for the student, its own
mass outside the teacher's k ids), and the divergence is taken between those. Not renormalised over the k
ids: the bucket keeps the distributions proper, makes the loss a lower bound of the full one that is exact
when the teacher's mass is all in its k ids, and needs only k + 1 numbers per token from the teacher (what an
offline teacher stores).

The sums are token-weighted: `chunked_kd` returns Σ over the trained tokens of kd_weight·KD + (1 -
kd_weight)·CE (CE: the student's next-token cross-entropy on the labels at temperature 1, as SFT's), and the
caller divides by the global trained-token count, so any world size and accumulation split gives the same loss.
Its gradient is taken per chunk in the forward pass (autograd on one chunk's logits), as the chunked
cross-entropy does (llmtrain.losses.token), so only one chunk's logits and their gradient are ever alive.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

LOSSES = ("forward_kl", "reverse_kl", "jsd")


def jsd_beta(loss: str, beta: float) -> float:
    """The β of the generalized JSD each loss is: forward_kl 0, reverse_kl 1, jsd its own."""
    return {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": beta}[loss]


class Dist(NamedTuple):
    """One side's next-token log-probs for a chunk of tokens: over the shared vocabulary ([n, V], ids None),
    or over the teacher's top-k ids then the bucket of every other id ([n, k + 1], ids [n, k])."""
    logps: torch.Tensor
    ids: torch.Tensor | None


def log_probs(logits: torch.Tensor, vocab: int, temperature: float) -> torch.Tensor:
    """fp32 log-softmax over the first `vocab` ids (the real ones: padding rows dropped) of logits / T."""
    z = logits[:, :vocab].float()
    return (z / temperature if temperature != 1 else z).log_softmax(-1)


def teacher_dist(logits: torch.Tensor, vocab: int, temperature: float, top_k: int) -> Dist:
    """The teacher's side: full log-probs (top_k 0), or its top-k log-probs and the log of the rest's mass."""
    logps = log_probs(logits, vocab, temperature)
    if not top_k:
        return Dist(logps, None)
    top, ids = logps.topk(top_k, dim=-1)
    return Dist(torch.cat([top, _rest(logps, ids)], 1), ids)


def student_dist(logits: torch.Tensor, vocab: int, temperature: float, ids: torch.Tensor | None) -> Dist:
    """The student's side, on the teacher's ids (None: the whole shared vocabulary)."""
    logps = log_probs(logits, vocab, temperature)
    if ids is None:
        return Dist(logps, None)
    return Dist(torch.cat([logps.gather(1, ids), _rest(logps, ids)], 1), ids)


def _rest(logps: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log of the mass outside `ids`, per row ([n, 1]): a logsumexp of the other log-probs (exact, unlike
    log(1 - Σ p_k), which cancels when the k ids hold nearly all the mass)."""
    return logps.scatter(1, ids, float("-inf")).logsumexp(-1, keepdim=True)


def divergence(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """Per token ([n]): the generalized JSD of the two log-prob rows (see the module's docstring); β = 0
    and β = 1 are the forward and reverse KL, computed directly."""
    if beta == 0:
        return _kl(teacher, student)
    if beta == 1:
        return _kl(student, teacher)
    mixture = torch.logaddexp(teacher + math.log(beta), student + math.log(1 - beta))
    return beta * _kl(teacher, mixture) + (1 - beta) * _kl(student, mixture)


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row from log-probs: Σ exp(p) (p - q) (F.kl_div(q, p, log_target=True) summed)."""
    return (p.exp() * (p - q)).sum(-1)


class KDSums(NamedTuple):
    loss: torch.Tensor  # Σ over trained tokens of kd_weight·KD + (1 - kd_weight)·CE (differentiable)
    kd: torch.Tensor    # Σ of the KD term alone (detached)
    ce: torch.Tensor    # Σ of the student's cross-entropy on the labels (detached)


class KDParams(NamedTuple):
    vocab: int          # the shared real vocabulary (len(tokenizer))
    beta: float         # jsd_beta(loss, distill.jsd_beta)
    temperature: float
    kd_weight: float


def chunked_kd(student_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor,
               teacher: Callable[[slice], Dist], params: KDParams, chunk_tokens: int,
               leaves: list[torch.Tensor]) -> KDSums:
    """KD (and CE) sums over the trained tokens whose final hidden states are `hidden` ([n, H], the student's)
    and next tokens `targets` ([n]): student_logits(rows of hidden) -> their logits (the student's output
    layer); teacher(row slice) -> the teacher's Dist of those rows (computed on demand: its logits live for
    one chunk too); leaves: the student output layer's tensors that take a gradient (besides hidden)."""
    if not torch.is_grad_enabled():
        sums = torch.zeros(3, dtype=torch.float32, device=hidden.device)
        for rows in _chunks(len(targets), chunk_tokens):
            sums += torch.stack(_chunk_sums(student_logits(hidden[rows]), targets[rows], teacher(rows), params))
        return KDSums(*sums)
    loss, kd, ce = _ChunkedKD.apply(student_logits, hidden, targets, teacher, params, chunk_tokens, *leaves)
    return KDSums(loss, kd, ce)


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(start, start + size) for start in range(0, max(n, 1), size)]


def _chunk_sums(logits: torch.Tensor, targets: torch.Tensor, teacher: Dist, params: KDParams):
    """(loss, kd, ce) sums of one chunk from the student's logits."""
    student = student_dist(logits, params.vocab, params.temperature, teacher.ids)
    kd = divergence(student.logps, teacher.logps, params.beta).sum()
    ce = F.cross_entropy(logits.float(), targets, reduction="sum")
    return params.kd_weight * kd + (1 - params.kd_weight) * ce, kd.detach(), ce.detach()


class _ChunkedKD(torch.autograd.Function):
    """Forward takes each chunk's gradients w.r.t. its hidden rows and the output layer's leaves at once (the
    loss is a plain sum, so they are final up to the incoming scale) and keeps only those; backward scales
    them. Outputs: the loss (differentiable), then the KD and CE sums (not)."""

    @staticmethod
    def forward(ctx, student_logits, hidden, targets, teacher, params, chunk_tokens, *leaves):
        trained = [i for i, leaf in enumerate(leaves) if leaf is not None and leaf.requires_grad]
        grad_hidden = torch.zeros_like(hidden)
        grad_leaves = [None] * len(leaves)
        sums = torch.zeros(3, dtype=torch.float32, device=hidden.device)
        for rows in _chunks(len(targets), chunk_tokens):
            dist = teacher(rows)
            with torch.enable_grad():
                h = hidden[rows].detach().requires_grad_()
                loss, kd, ce = _chunk_sums(student_logits(h), targets[rows], dist, params)
            grads = torch.autograd.grad(loss, [h, *(leaves[i] for i in trained)])
            grad_hidden[rows] = grads[0]
            for i, g in zip(trained, grads[1:]):
                grad_leaves[i] = g if grad_leaves[i] is None else grad_leaves[i].add_(g)
            sums += torch.stack([loss.detach(), kd, ce])
        ctx.save_for_backward(grad_hidden, *(g for g in grad_leaves if g is not None))
        ctx.trained, ctx.n_leaves = trained, len(leaves)
        # Three tensors of their own, not views of `sums`: the loss is the student's forward output under
        # fully_shard, and FSDP2 warns on every view it returns (an in-place op on one would skip its hook).
        loss, kd, ce = (s.clone() for s in sums.unbind())
        ctx.mark_non_differentiable(kd, ce)
        return loss, kd, ce

    @staticmethod
    def backward(ctx, grad_loss, _kd, _ce):
        grad_hidden, *saved = ctx.saved_tensors
        grad_leaves = [None] * ctx.n_leaves
        for i, g in zip(ctx.trained, saved):
            grad_leaves[i] = g.mul_(grad_loss)
        return None, grad_hidden.mul_(grad_loss), None, None, None, None, *grad_leaves
