"""Ulysses sequence parallelism (parallel.sp_size): the ranks of a sequence group hold the same rows, each
forwards its `seq_len / sp_size` slice of them, and attention alone sees the whole sequence: before it an
all-to-all trades the sequence for heads (each rank attends over all S positions for heads / sp_size of the
heads), after it a second all-to-all trades them back (DeepSpeed-Ulysses; ALST in DeepSpeed / TRL and verl's
ulysses utilities do the same). Everything else a decoder layer does is per token, so it runs on the slice.

What keeps it exact: position ids are sliced from the whole row (RoPE sees the unsplit positions) and the
attention mask is built from the whole row's position ids (a packed row's examples still attend only to
themselves); the next-token targets are shifted on the whole row before slicing (a slice's last position
predicts the next slice's first token); the row is padded to a multiple of sp_size with ignored targets, the
pads a segment of their own. Key/value heads fewer than sp_size are replicated (each rank's query heads keep
their own key/value head); heads not divisible by sp_size are refused at set-up (`check`).

`split` is the one entry: TokenLoss (llmtrain.losses.token) runs every forward of a training objective inside
it; the attention function (llmtrain.models.attention) calls `attention` while a split is active and the
plain kernel otherwise (an unsplit forward: the output-layer probe, generation).

What a forward returns is made the whole rows' on every rank of the group (`whole`: a summed loss, per-row sums;
`Split.whole_tokens`: the per-token log-probs DPO's and GRPO's losses take), so an objective computes the same
value on each rank of a group from the whole rows, as if unsplit; its gradient flows back to each rank's own slice
only, so the ranks' gradients summed (the step's reduce-scatter over the world) are the whole rows' once. The step
then counts a group's sums once (`once`)."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv

from llmtrain.config import ConfigError
from llmtrain.models import dropout

KERNEL = "llmtrain_sdpa"  # the attention implementation that runs a split (models.attention.NAME)


def check(sp_size: int, world_size: int, seq_len: int, kernel: str, heads: int, kv_heads: int) -> None:
    """Before any process group: the sequence group fits the world, the rows, the attention and the heads (one
    line each); kernel: the attention implementation the model gets (models.attention.choose)."""
    if sp_size == 1:
        return
    if sp_size > world_size or world_size % sp_size:
        raise ConfigError(f"parallel.sp_size={sp_size} must divide the world size {world_size} (the ranks form "
                          f"data-parallel groups of sp_size ranks each); launch a multiple of {sp_size} processes "
                          "or lower parallel.sp_size")
    if seq_len % sp_size:
        raise ConfigError(f"data.seq_len={seq_len} is not divisible by parallel.sp_size={sp_size}: each rank holds "
                          f"seq_len / sp_size tokens of a row; use a data.seq_len that is a multiple of {sp_size}")
    if kernel != KERNEL:
        raise ConfigError(f"parallel.sp_size={sp_size} runs attention through llmtrain's sdpa, but this model gets "
                          f"{kernel} (model.attn_implementation): use model.attn_implementation=sdpa with a family "
                          "that supports it")
    if heads % sp_size:
        raise ConfigError(f"parallel.sp_size={sp_size} must divide the model's {heads} attention heads (each rank "
                          "attends with heads / sp_size of them); pick an sp_size that divides it")
    if kv_heads % sp_size and sp_size % kv_heads:
        raise ConfigError(f"the model's {kv_heads} key/value heads and parallel.sp_size={sp_size}: one must divide "
                          "the other (fewer key/value heads than sp_size are replicated); pick such an sp_size")


class Split(NamedTuple):
    """A forward's split: this rank's part of the rows, and what attention needs of the whole rows."""
    input_ids: torch.Tensor     # [B, S / sp] this rank's slice
    position_ids: torch.Tensor  # [B, S / sp]
    targets: torch.Tensor       # [B, S / sp] next-token targets (shifted on the whole row), IGNORE on the pads
    group: dist.ProcessGroup | None = None
    segments: torch.Tensor | None = None  # [B, S] the whole rows' segment ids (packed examples, the pads)
    start: int = 0                    # the slice's first position in its rows
    trained: torch.Tensor | None = None  # [B, S] bool: the whole (padded) rows' trained positions

    def whole(self, value: torch.Tensor) -> torch.Tensor:
        """This slice's sums -> the whole rows' (module function `whole`)."""
        return whole(self.group, value)

    def whole_tokens(self, flat: torch.Tensor) -> torch.Tensor:
        """Values of this slice's trained tokens (row-major) -> those of the whole rows' trained tokens, in the
        whole rows' row-major order (what an unsplit forward gives), on every rank of the group; the gradient goes
        to this slice's own."""
        if self.group is None:
            return flat
        own = self.trained[:, self.start:self.start + self.input_ids.shape[1]]
        grid = F.pad(flat.new_zeros(own.shape).masked_scatter(own, flat),
                     (self.start, self.trained.shape[1] - self.start - own.shape[1]))
        return whole(self.group, grid)[self.trained]

    def own_tokens(self, flat: torch.Tensor) -> torch.Tensor:
        """The reverse of whole_tokens: values of the whole rows' trained tokens (row-major, e.g. a stored
        teacher's) -> this slice's."""
        if self.group is None:
            return flat
        number = (self.trained.flatten().cumsum(0) - 1).view_as(self.trained)
        cut = slice(self.start, self.start + self.input_ids.shape[1])
        return flat[number[:, cut][self.trained[:, cut]]]


_active: Split | None = None  # the forward in progress (module-global, as dropout's keys)


def active() -> Split | None:
    return _active


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S]: the number of each position's run of consecutive position ids (a packed row's examples, the
    pads), as transformers reads packed rows from their position ids."""
    starts = F.pad(position_ids[:, 1:] - position_ids[:, :-1] != 1, (1, 0), value=False)
    return starts.cumsum(1)


def block_mask(segments: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """[B, 1, b - a, b] bool: the block-causal mask of queries a:b over keys :b (causal within each segment);
    built a block at a time, the whole S x S mask never is."""
    queries = torch.arange(a, b, device=segments.device)[:, None]
    causal = queries >= torch.arange(b, device=segments.device)[None, :]
    return ((segments[:, a:b, None] == segments[:, None, :b]) & causal)[:, None]


@contextlib.contextmanager
def split(group: dist.ProcessGroup | None, input_ids: torch.Tensor, position_ids: torch.Tensor,
          targets: torch.Tensor, ignore: int):
    """Yields this rank's Split of the rows (the rows themselves without a group) and keeps it active for the
    forwards inside the block; `ignore`: the target of the pads. Collective over `group` (the forwards'
    all-to-alls)."""
    if group is None:
        yield Split(input_ids, position_ids, targets)
        return
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    pad = -input_ids.shape[1] % size
    if pad:  # the pads: a segment of their own (positions from 0), no targets
        input_ids = F.pad(input_ids, (0, pad), value=0)
        position_ids = torch.cat([position_ids, torch.arange(pad, device=position_ids.device).expand(
            position_ids.shape[0], pad)], 1)
        targets = F.pad(targets, (0, pad), value=ignore)
    part = input_ids.shape[1] // size
    cut = slice(rank * part, (rank + 1) * part)
    with _activated(Split(input_ids[:, cut], position_ids[:, cut], targets[:, cut], group,
                          segment_ids(position_ids), rank * part, targets != ignore)) as active_split:
        yield active_split


@contextlib.contextmanager
def _activated(s: Split | None):
    global _active
    saved, _active = _active, s
    try:
        with dropout.offset(s.start if s is not None else 0):  # keyed dropout masks by the whole row's positions
            yield s
    finally:
        _active = saved


def recompute_contexts():
    """torch.utils.checkpoint's context_fn (parallel.activation_checkpointing): a layer's recompute in the
    backward pass runs under the split its forward ran under."""
    return contextlib.nullcontext(), _activated(_active)


def once(group: dist.ProcessGroup | None, value: torch.Tensor) -> torch.Tensor:
    """`value` on the first rank of the sequence group, zeros on the others: a value every rank of the group
    holds alike (its rows' trained tokens, an objective's whole-row sums) summed over all ranks counts each row
    once."""
    return value if group is None or dist.get_rank(group) == 0 else torch.zeros_like(value)


def group_batches(group: dist.ProcessGroup | None, batches: list[dict]) -> list[dict]:
    """Rows each rank of a sequence group holds on its own (GRPO's completions, sampled unsplit per rank) -> every
    rank's micro-batches of the group, in rank order, on each rank: the group then trains on all of them, each rank
    its slice of every row. Collective over `group`."""
    if group is None:
        return batches
    device = batches[0]["input_ids"].device
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, [{k: v.cpu() for k, v in b.items()} for b in batches], group=group)
    return [{k: v.to(device) for k, v in b.items()} for part in parts for b in part]


def own_part(group: dist.ProcessGroup | None, values: list | None) -> list | None:
    """Per-row values of group_batches' rows (in its order) -> those of this rank's own rows."""
    if group is None or values is None:
        return values
    n = len(values) // dist.get_world_size(group)
    return values[dist.get_rank(group) * n:(dist.get_rank(group) + 1) * n]


def own_tokens(flat: torch.Tensor) -> torch.Tensor:
    """Split.own_tokens of the active split (the values themselves outside one)."""
    return flat if _active is None else _active.own_tokens(flat)


class _GroupSum(torch.autograd.Function):
    """Forward: the sum over the group. Backward: the gradient as it is, to this rank's own part: every rank of
    the group computes the same objective from the sum, and each passes back its own part's share only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def whole(group: dist.ProcessGroup | None, value: torch.Tensor) -> torch.Tensor:
    """A sum over this rank's slice of the rows (a loss, per-row sums) -> the same sum over the whole rows, equal
    on every rank of the sequence group; differentiable (module docstring). Collective over `group`."""
    return value if group is None else _GroupSum.apply(value, group)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (one block per rank); its gradient is the same exchange back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)  # of the contiguous input: empty_like keeps a transposed tensor's strides
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, H, S / sp, D] (all heads, this rank's positions) -> [B, H / sp, S, D] (this rank's heads, all positions)."""
    size = dist.get_world_size(group)
    b, h, s, d = x.shape
    out = _AllToAll.apply(x.reshape(b, size, h // size, s, d).transpose(0, 1), group)  # [sp: position block, ...]
    return out.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, S, H / sp, D] (attention's output layout) -> [B, S / sp, H, D]."""
    size = dist.get_world_size(group)
    b, s, h, d = x.shape
    out = _AllToAll.apply(x.reshape(b, size, s // size, h, d).transpose(0, 1), group)  # [sp: head block, ...]
    return out.permute(1, 2, 0, 3, 4).reshape(b, s // size, size * h, d)


def attention(kernel, query, key, value, dropout_p: float = 0.0, scaling=None):
    """transformers' attention call for the active split: query [B, H, S/sp, D], key/value [B, KV, S/sp, D] ->
    ([B, S/sp, H, D], None), by `kernel` (models.attention.whole_rows_sdpa) over all S positions for this rank's
    heads, causal within the whole rows' segments."""
    s = _active
    size = dist.get_world_size(s.group)
    if key.shape[1] % size:  # fewer key/value heads than ranks: rank r's query heads use kv head r * KV // sp
        key, value = repeat_kv(key, size // key.shape[1]), repeat_kv(value, size // value.shape[1])
    q, k, v = (seq_to_heads(t, s.group) for t in (query, key, value))
    out = kernel(q, k, v, s.segments, dropout_p, scaling)
    return heads_to_seq(out, s.group), None
