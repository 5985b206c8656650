"""Training rows from completions: what the policy-gradient loss scores (prompt + completion, labels on the
completion's tokens), built the same way whichever engine sampled them."""

from __future__ import annotations

import torch

from llmtrain.data.formats import IGNORE
from llmtrain.rollout.local import Completions, from_lists


def training_rows(prompts: list[list[int]], completions: Completions, pad_id: int,
                  mask_truncated: bool) -> dict[str, torch.Tensor]:
    """The rows the loss scores (TokenLoss.token_logps): prompt + completion, right-padded, with
    position_ids from 0 and labels = the completion's tokens (its EOS included), IGNORE elsewhere, and
    for a truncated completion too when mask_truncated (grpo.mask_truncated_completions: it still counts
    as a completion in grpo's and dr_grpo's denominators, as in TRL)."""
    ids, mask = completions.ids.cpu(), completions.mask.cpu()
    keep = mask & ~completions.truncated.cpu()[:, None] if mask_truncated else mask
    width = max(len(p) for p in prompts) + ids.shape[1]
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    labels = torch.full_like(input_ids, IGNORE)
    for i, p in enumerate(prompts):
        n = int(mask[i].sum())
        input_ids[i, :len(p)] = torch.tensor(p)
        input_ids[i, len(p):len(p) + n] = ids[i, :n]
        labels[i, len(p):len(p) + n] = ids[i, :n].masked_fill(~keep[i, :n], IGNORE)
    return {"input_ids": input_ids, "labels": labels,
            "position_ids": torch.arange(width).expand(len(prompts), -1).contiguous()}


def micro_batches(prompts: list[list[int]], tokens: list[list[int]], truncated: list[bool], pad_id: int, n: int,
                  mask_truncated: bool, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Completion i of prompt i (each completion's tokens, its first EOS included) -> training rows in
    micro-batches of n, on `device`."""
    out = []
    for i in range(0, len(tokens), n):
        rows = training_rows(prompts[i:i + n], from_lists(tokens[i:i + n], truncated[i:i + n], pad_id), pad_id,
                             mask_truncated)
        out.append({k: v.to(device) for k, v in rows.items()})
    return out
