"""One token-weighted loss: the sum of per-token losses over every micro-batch and rank, divided by the
global count of trained tokens. Gradients then equal those of one big batch, whatever the split."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmtrain.data import IGNORE


def trained_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Tokens that carry a loss: label positions 1.. (position 0 predicts nothing) that are not ignored."""
    return (labels[:, 1:] != IGNORE).sum()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropies, in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=IGNORE, reduction="sum")
