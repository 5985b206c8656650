"""llmtrain.losses.distill: the chunked KD sums equal an independent full-logits computation (TRL's kl_div
formulation of the generalized JSD; the top-k bucket from explicit masks) for each loss x temperature x top_k,
gradients included, with the student's output layer padded beyond the shared vocabulary; student == teacher
gives 0; the chunk size changes nothing; the sums are no views (FSDP2 warns on a view its module returns)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from llmtrain.losses import distill as kd

V, PAD, H, N = 37, 5, 16, 23  # shared vocabulary, the student's padding rows (the teacher's: 2), hidden size, tokens
# Sums over tokens are compared relatively: a float32 sum of n terms in another order (another chunking, another
# CPU's kernels: 3 ulps of a sum of ~61 on an AMD EPYC) moves by up to ~n * 2^-24 of its size.
SUM = 1e-5


def reference(student_logits, teacher_logits, targets, loss, beta, temperature, top_k, kd_weight):
    """Full logits, written the way TRL's GKDTrainer.generalized_jsd_loss is (F.kl_div, log_target)."""
    s = F.log_softmax(student_logits[:, :V] / temperature, -1)
    t = F.log_softmax(teacher_logits[:, :V] / temperature, -1)
    if top_k:
        ids = t.topk(top_k, -1).indices
        inside = torch.zeros_like(t, dtype=torch.bool).scatter(1, ids, True)

        def bucket(x):
            rest = torch.log((x.exp() * ~inside).sum(-1, keepdim=True))
            return torch.cat([x.gather(1, ids), rest], 1)
        s, t = bucket(s), bucket(t)
    b = kd.jsd_beta(loss, beta)
    if b == 0:
        div = F.kl_div(s, t, reduction="none", log_target=True)
    elif b == 1:
        div = F.kl_div(t, s, reduction="none", log_target=True)
    else:
        m = torch.logsumexp(torch.stack([s + torch.log(torch.tensor(1 - b)), t + torch.log(torch.tensor(b))]), 0)
        div = b * F.kl_div(m, t, reduction="none", log_target=True) + \
            (1 - b) * F.kl_div(m, s, reduction="none", log_target=True)
    ce = F.cross_entropy(student_logits, targets, reduction="sum")
    return kd_weight * div.sum() + (1 - kd_weight) * ce


def setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64).float()
    weight = (torch.randn(V + PAD, H, generator=g) * 0.5).requires_grad_()
    teacher_logits = torch.randn(N, V + 2, generator=g) * 2  # padded too, by another amount
    targets = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, teacher_logits, targets


def chunked(hidden, weight, teacher_logits, targets, loss, beta, temperature, top_k, kd_weight, chunk):
    h = hidden.clone().requires_grad_()
    params = kd.KDParams(V, kd.jsd_beta(loss, beta), temperature, kd_weight)
    sums = kd.chunked_kd(lambda x: x @ weight.T, h, targets,
                         lambda rows: kd.teacher_dist(teacher_logits[rows], V, temperature, top_k),
                         params, chunk, [weight])
    grads = torch.autograd.grad(sums.loss, [h, weight])
    return sums, grads


@pytest.mark.parametrize("loss,temperature,top_k",
                         list(itertools.product(kd.LOSSES, (1.0, 0.7, 2.0), (0, 1, 5))))
def test_equals_full_logits(loss, temperature, top_k):
    hidden, weight, teacher_logits, targets = setup()
    kd_weight, beta = 0.75, 0.3
    sums, (g_h, g_w) = chunked(hidden, weight, teacher_logits, targets, loss, beta, temperature, top_k, kd_weight, 7)
    h = hidden.clone().requires_grad_()
    want = reference(h @ weight.T, teacher_logits, targets, loss, beta, temperature, top_k, kd_weight)
    w_h, w_w = torch.autograd.grad(want, [h, weight])
    assert sums.loss.item() == pytest.approx(want.item(), rel=SUM, abs=1e-5)
    assert torch.allclose(g_h, w_h, atol=1e-5, rtol=1e-5)
    assert torch.allclose(g_w, w_w, atol=1e-5, rtol=1e-5)
    # the two detached parts add up to the loss
    ce = F.cross_entropy(hidden @ weight.T, targets, reduction="sum").item()
    assert sums.ce.item() == pytest.approx(ce, rel=SUM)
    assert kd_weight * sums.kd.item() + (1 - kd_weight) * sums.ce.item() == pytest.approx(sums.loss.item(), rel=SUM)


@pytest.mark.parametrize("loss", kd.LOSSES)
@pytest.mark.parametrize("top_k", (0, 4))
def test_student_equals_teacher_gives_zero(loss, top_k):
    hidden, weight, _, targets = setup(1)
    teacher_logits = (hidden @ weight.T).detach()  # the same model, padding rows and all
    sums, (g_h, g_w) = chunked(hidden, weight, teacher_logits, targets, loss, 0.5, 1.5, top_k, 1.0, 5)
    assert abs(sums.kd.item()) < 1e-5 and abs(sums.loss.item()) < 1e-5
    assert g_h.abs().max() < 1e-5 and g_w.abs().max() < 1e-5


@pytest.mark.parametrize("loss", kd.LOSSES)
def test_chunk_size_changes_nothing(loss):
    hidden, weight, teacher_logits, targets = setup(2)
    runs = [chunked(hidden, weight, teacher_logits, targets, loss, 0.4, 1.3, 3, 0.5, c) for c in (1, 4, N, 1000)]
    for sums, grads in runs[1:]:
        assert sums.loss.item() == pytest.approx(runs[0][0].loss.item(), rel=SUM, abs=1e-5)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, runs[0][1]))


def test_no_grad_gives_the_same_sums():
    hidden, weight, teacher_logits, targets = setup(3)
    sums, _ = chunked(hidden, weight, teacher_logits, targets, "jsd", 0.5, 1.0, 0, 0.5, 6)
    with torch.no_grad():
        params = kd.KDParams(V, 0.5, 1.0, 0.5)
        plain = kd.chunked_kd(lambda x: x @ weight.T, hidden, targets,
                              lambda rows: kd.teacher_dist(teacher_logits[rows], V, 1.0, 0), params, 6, [weight])
    assert torch.allclose(torch.stack(list(plain)), torch.stack([sums.loss.detach(), sums.kd, sums.ce]), atol=1e-5)


def test_sums_are_not_views():
    """The sums are the student's forward output under fully_shard, where FSDP2 warns on a returned view ("an
    in-place op on this view ... can cause backward to fail"): each is a tensor of its own."""
    hidden, weight, teacher_logits, targets = setup(4)
    sums, _ = chunked(hidden, weight, teacher_logits, targets, "jsd", 0.5, 1.0, 0, 0.5, 6)
    assert [s._base for s in sums] == [None, None, None]
