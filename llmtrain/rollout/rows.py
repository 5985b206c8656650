"""Training rows from completions: what the policy-gradient loss scores (prompt + completion, labels on the
completion's tokens), built the same way whichever engine sampled them; with their advantages and log-probs
(the engine's, the trainer's at sampling time, a reference's) as GRPO's loss takes them; and the generation
batch a checkpoint keeps (GenerationBatch)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from llmtrain import distributed
from llmtrain.data import SAMPLE_INDEX
from llmtrain.data.formats import IGNORE
from llmtrain.losses.policy import to_grid
from llmtrain.losses.token import next_token_targets
from llmtrain.rollout.local import CompletionGrid, from_lists


def training_rows(prompts: list[list[int]], completions: CompletionGrid, pad_id: int,
                  mask_truncated: bool, tool_mask: list[list[int]] | None = None) -> dict[str, torch.Tensor]:
    """The rows the loss scores (TokenLoss.token_logps): prompt + completion, right-padded, with
    position_ids from 0 and labels = the completion's tokens (its EOS included), IGNORE elsewhere, and
    for a truncated completion too when mask_truncated (grpo.mask_truncated_completions: it still counts
    as a completion in grpo's and dr_grpo's denominators, as in TRL). A multi-turn trajectory's tool tokens
    (tool_mask 0, TRL's) are context only: IGNORE, so out of the loss, its token counts and the drift guard."""
    ids, mask = completions.ids.cpu(), completions.mask.cpu()
    keep = mask & ~completions.truncated.cpu()[:, None] if mask_truncated else mask
    if tool_mask is not None:
        keep = keep & from_lists(tool_mask, [False] * len(tool_mask), 0).ids.bool()[:, :keep.shape[1]]
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
                  mask_truncated: bool, device: torch.device,
                  tool_mask: list[list[int]] | None = None) -> list[dict[str, torch.Tensor]]:
    """Completion i of prompt i (each completion's tokens, its first EOS included) -> training rows in
    micro-batches of n, on `device`."""
    out = []
    for i in range(0, len(tokens), n):
        rows = training_rows(prompts[i:i + n], from_lists(tokens[i:i + n], truncated[i:i + n], pad_id), pad_id,
                             mask_truncated, None if tool_mask is None else tool_mask[i:i + n])
        out.append({k: v.to(device) for k, v in rows.items()})
    return out


def completion_mask(batch: dict) -> torch.Tensor:
    """The trained tokens of a micro-batch of training rows (a completion's, up to and including its EOS), as
    next-token targets: where a completion's log-probs go (to_grid)."""
    return next_token_targets(batch["labels"]) != IGNORE


def policy_rows(prompt_ids: list[list[int]], tokens: list[list[int]], truncated: list[bool], advantages: list[float],
                engine_logps: list[list[float]], rows: range, n: int, pad_id: int, mask_truncated: bool,
                device: torch.device, tool_mask: list[list[int]] | None = None) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of n training rows (completion i of prompt_ids[i]) with their advantages, the engine's log-probs
    of the trained tokens (engine_logps; a completion left out of the loss, mask_truncated, has none; a trajectory's
    tool tokens, tool_mask 0, neither) and SAMPLE_INDEX, the completion's index in the step's global order (rows:
    this rank's), which keys its dropout."""
    micro = micro_batches(prompt_ids, tokens, truncated, pad_id, n, mask_truncated, device, tool_mask)
    model_tokens = tool_mask or [[1] * len(row) for row in engine_logps]
    for i, b in enumerate(micro):
        part = slice(i * n, (i + 1) * n)
        trained = [x for row, cut, m in zip(engine_logps[part], truncated[part], model_tokens[part])
                   if not (cut and mask_truncated) for x, own in zip(row, m) if own]
        b.update(advantages=torch.tensor(advantages[part], device=device),
                 engine_logps=to_grid(torch.tensor(trained, device=device), completion_mask(b)))
        b[SAMPLE_INDEX] = torch.tensor(rows[part], device=device)
    return micro


def attach_logps(micro: list[dict], name: str, flats: list[torch.Tensor]) -> list[list[float]]:
    """Each micro-batch's flat log-probs of its trained tokens as its [rows, tokens] grid under `name`; -> per
    completion lists (what a checkpoint keeps)."""
    out = []
    for b, flat in zip(micro, flats):
        b[name] = to_grid(flat, completion_mask(b))
        out += [row[k].tolist() for row, k in zip(b[name], completion_mask(b))]
    return out


def attach_saved_logps(micro: list[dict], name: str, per_completion: list[list[float]], n: int) -> None:
    """attach_logps from per completion lists (a checkpoint's), n completions per micro-batch."""
    for i, b in enumerate(micro):
        flat = torch.tensor(sum(per_completion[i * n:(i + 1) * n], []), device=b["labels"].device)
        b[name] = to_grid(flat, completion_mask(b))


def trainer_logps(token_loss, model: torch.nn.Module, autocast, micro: list[dict],
                  temperature: float) -> list[torch.Tensor]:
    """The policy's log-probs of each micro-batch's trained tokens now, flat (the loss's own computation)."""
    with torch.no_grad(), autocast():
        return [token_loss.token_logps(model, b, temperature) for b in micro]


def reference_logps(ref, micro: list[dict], temperature: float) -> list[torch.Tensor]:
    """A frozen reference's (llmtrain.train.frozen.FrozenModel) log-probs of each micro-batch's trained tokens, flat."""
    return [ref.forward(lambda model, token_loss: token_loss.token_logps(model, b, temperature)) for b in micro]


@dataclass
class GenerationBatch:
    """A generation batch, every rank's completions in the step's global order, JSON-able (a checkpoint's source
    state): their tokens, truncation, advantages, and the log-probs of their trained tokens: the trainer's at
    sampling time (old), the reference's (ref), the engine's (engine); and the batch's logged metrics; for
    multi-turn trajectories (llmtrain.rollout.agent) their tool_mask and the prompts' ids as rendered with tools."""
    step: int                          # the generation batch's index
    completions: list[list[int]]
    truncated: list[bool]
    advantages: list[float]
    old: list[list[float]] | None
    ref: list[list[float]] | None
    engine: list[list[float]] | None
    metrics: dict
    tool_mask: list[list[int]] | None = None
    prompt_ids: list[list[int]] | None = None

    @classmethod
    def gathered(cls, step: int, tokens, truncated, advantages, old, ref, engine, metrics: dict, tool_mask=None,
                 prompt_ids=None) -> GenerationBatch:
        """Collective: from this rank's parts, every rank's (in rank order: the global order)."""
        parts = distributed.gather_objects((tokens, truncated, old, ref, engine, tool_mask, prompt_ids))
        joined = [sum((p[i] for p in parts), []) if parts[0][i] is not None else None for i in range(7)]
        return cls(step, joined[0], joined[1], advantages, joined[2], joined[3], joined[4], metrics, joined[5],
                   joined[6])

    @classmethod
    def from_state(cls, state: dict) -> GenerationBatch:
        """From a checkpoint's state_dict (one saved before the drift guard has no engine log-probs: its old)."""
        return cls(**{"engine": state.get("old"), **state})

    def part(self, rows: range) -> GenerationBatch:
        """These completions only (a rank's)."""
        cut = lambda v: None if v is None else v[rows.start:rows.stop]  # noqa: E731
        return dataclasses.replace(self, completions=cut(self.completions), truncated=cut(self.truncated),
                                   advantages=cut(self.advantages), old=cut(self.old), ref=cut(self.ref),
                                   engine=cut(self.engine), tool_mask=cut(self.tool_mask),
                                   prompt_ids=cut(self.prompt_ids))
