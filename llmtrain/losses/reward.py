"""The Bradley–Terry reward-model loss (TRL 1.16's RewardTrainer.compute_loss) over batches laid out as
llmtrain.data.preference.collate_pairs makes them: B chosen rows, then the B rejected rows of the same pairs, one
score (reward) per row.

Per pair, with r_c, r_r the chosen and rejected rewards and m the pair's margin (0 without one):
    -log σ(r_c - r_r - m) + c (r_c + r_r)²     c = center_rewards_coefficient (Eisenstein et al. 2023's centring)
The loss is their mean over every pair of the global batch whatever the split into micro-batches and ranks: each
micro-batch gives sums, the recipe divides by the global pair count. The metrics are TRL's: accuracy (r_c > r_r),
margin (r_c - r_r), means over pairs; mean_reward, min_reward, max_reward over every reward of the step's batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

METRICS = ("accuracy", "margin", "mean_reward", "min_reward", "max_reward")


class RewardSums(NamedTuple):
    loss: torch.Tensor     # Σ over pairs of the loss (differentiable)
    sums: torch.Tensor     # Σ over pairs of [r_c > r_r, r_c - r_r, r_c + r_r] (detached)
    extrema: torch.Tensor  # [max reward, -min reward] (detached): reduced with MAX, not summed


def reward_sums(rewards: torch.Tensor, margin: torch.Tensor | None = None,
                center_coefficient: float = 0.0) -> RewardSums:
    """rewards: one per row, chosen rows then rejected rows; margin: one per pair, or None."""
    chosen, rejected = rewards.float().chunk(2)
    z = chosen - rejected
    losses = -F.logsigmoid(z if margin is None else z - margin)
    if center_coefficient:
        losses = losses + center_coefficient * (chosen + rejected) ** 2
    z, total = z.detach(), (chosen + rejected).detach()
    return RewardSums(losses.sum(), torch.stack([(z > 0).sum().float(), z.sum(), total.sum()]),
                      torch.stack([rewards.detach().float().max(), -rewards.detach().float().min()]))


def metrics(summed: torch.Tensor, extrema: torch.Tensor, pairs: int) -> dict[str, float]:
    """METRICS from the sums over micro-batches and ranks and the extrema, [max, -min] over them."""
    pairs = max(pairs, 1)
    accuracy, margin, total = summed.tolist()
    return dict(zip(METRICS, (accuracy / pairs, margin / pairs, total / (2 * pairs), -extrema[1].item(),
                              extrema[0].item())))
