"""One token-weighted loss: the sum of per-token losses over every micro-batch and rank, divided by the
global count of trained tokens. Gradients then equal those of one big batch, whatever the split."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmtrain.data.formats import IGNORE


def trained_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Tokens that carry a loss: label positions 1.. (position 0 predicts nothing) that are not ignored."""
    return (labels[:, 1:] != IGNORE).sum()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropies, in fp32 whatever the compute dtype. The labels are
    shifted left (the last position gets IGNORE) rather than the logits sliced: slicing would copy the
    whole logits tensor, and its gradient, every step."""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")


@torch.no_grad()
def evaluate(model, batches, device: torch.device, autocast) -> tuple[float, int]:
    """Token-weighted loss over every rank's validation batches: (global mean loss, global tokens).
    Collective: every rank must pass the same number of batches."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast():
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        totals += torch.stack([token_loss_sum(logits, batch["labels"]).double(),
                               trained_tokens(batch["labels"]).double()])
    dist.all_reduce(totals)
    model.train(was_training)
    return (totals[0] / totals[1].clamp(min=1)).item(), int(totals[1].item())
