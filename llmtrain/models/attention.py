"""SDPA for packed rows without the masked-out half of the work.

Packed rows restart position_ids at every example, so transformers hands sdpa a block-causal mask.
Given a mask, SDPA kernels compute every query x key block and then mask it; only with is_causal do
they skip the blocks above the diagonal. `chunked_sdpa` runs SDPA on CHUNKS slices of the queries,
each against the keys up to the slice's end (a causal mask hides the rest): the same numbers, and 3/8
of the attention work (4 chunks) not done. On CPU it also hands grouped key/value heads to the kernel
as they are (enable_gqa), where transformers copies them out per query head once a mask is given.
Unmasked (unpacked) input, or a query shorter than its keys (a KV cache), goes to transformers' sdpa.

Packed rows longer than LONG_ROWS go by example instead (segmented_sdpa: is_causal within each, no mask:
given one, the kernel keeps an fp32 copy of it per layer for the backward pass, quadratic in the row). Under
parallel.sp_size > 1 the same kernels run inside Ulysses' all-to-alls (llmtrain.models.ulysses) while a sequence
split is active, from the whole rows' segments; the whole S x S mask is never built.

model.attn_implementation=sdpa selects it (as `NAME`, a name only this process knows: transformers
does not write the attention implementation into an exported config.json).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from llmtrain.models import ulysses

NAME = ulysses.KERNEL
CHUNKS = 4
CHUNK_ROWS = 1024  # longer rows get more chunks: a chunk's mask (and the kernel's copy of it) stays small
LONG_ROWS = 4 * CHUNK_ROWS  # packed rows past this many positions are attended example by example


def chunked_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [batch, heads, q_len, dim], key/value [batch, kv_heads, k_len, dim], mask [batch, 1|heads,
    q_len, k_len]; returns ([batch, q_len, heads, dim], None), as transformers' sdpa does."""
    length = query.shape[2]
    if attention_mask is None or attention_mask.dim() != 4 or key.shape[2] != length or length < 2 * CHUNKS:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return blockwise_sdpa(query, key, value, lambda a, b: attention_mask[:, :, a:b, :b], dropout, scaling), None


def kernel_kv(query, key, value) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Key/value as the SDPA kernel takes them, and whether it groups them (enable_gqa): on CPU as they are; on
    CUDA repeated per query head (its masked kernels take no GQA: a math fallback)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and query.device.type != "cpu":
        return repeat_kv(key, groups), repeat_kv(value, groups), False
    return key, value, groups > 1


def blockwise_sdpa(query, key, value, mask_block, dropout: float, scaling) -> torch.Tensor:
    """chunked_sdpa's kernel: SDPA on slices of the queries, each against the keys up to the slice's end, under
    mask_block(a, b) ([batch, 1|heads, b - a, b] bool) for the query slice a:b; -> [batch, q_len, heads, dim]."""
    length = query.shape[2]
    key, value, gqa = kernel_kv(query, key, value)
    chunks = min(length, max(CHUNKS, -(-length // CHUNK_ROWS)))
    bounds = [length * i // chunks for i in range(chunks + 1)]
    outs = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, :b], value[:, :, :b],
                                           attn_mask=mask_block(a, b), dropout_p=dropout, scale=scaling,
                                           enable_gqa=gqa)
            for a, b in zip(bounds, bounds[1:])]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def segmented_sdpa(query, key, value, segments: torch.Tensor, dropout: float, scaling) -> torch.Tensor:
    """Long packed rows: SDPA with is_causal over each run of `segments` ([batch, q_len]: a packed row's examples)
    on its own, so no mask exists at all (a kernel given a mask keeps an fp32 copy of it for the backward pass,
    in every layer: quadratic in the row); -> [batch, q_len, heads, dim]. What a varlen flash kernel does."""
    key, value, gqa = kernel_kv(query, key, value)
    rows = []
    # split, not a slice per example: a slice's gradient is a zero-filled tensor of the whole row, one per
    # example (time and transient memory quadratic in the row); split's gradient is one concatenation
    for r, row in enumerate(zip(query.split(1), key.split(1), value.split(1))):
        sizes = torch.unique_consecutive(segments[r], return_counts=True)[1].tolist()
        rows.append(torch.cat([F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                                              scale=scaling, enable_gqa=gqa)
                               for q, k, v in zip(*(t.split(sizes, dim=2) for t in row))], dim=2))
    return torch.cat(rows).transpose(1, 2).contiguous()


def whole_rows_sdpa(query, key, value, segments: torch.Tensor, dropout: float, scaling) -> torch.Tensor:
    """The kernel over whole packed rows of segments [batch, length]: by segment past LONG_ROWS positions,
    by query chunks under block masks below (where the masks are small and fewer calls are faster)."""
    if query.shape[2] > LONG_ROWS:
        return segmented_sdpa(query, key, value, segments, dropout, scaling)
    return blockwise_sdpa(query, key, value, lambda a, b: ulysses.block_mask(segments, a, b), dropout, scaling)


def attend(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """What NAME runs: chunked_sdpa; on rows past LONG_ROWS positions (long_rows_mask's marker),
    segmented_sdpa by the examples' position ids; under a sequence split, whole_rows_sdpa over the whole
    sequence's positions."""
    if ulysses.active() is not None:
        return ulysses.attention(whole_rows_sdpa, query, key, value, dropout, scaling)
    if attention_mask is not None and attention_mask.shape[-1] == 0:  # long_rows_mask's marker
        if kwargs.get("position_ids") is None:
            raise RuntimeError(f"{type(module).__name__} passes no position_ids to its attention function: "
                               f"rows over {LONG_ROWS} positions need them (use model.attn_implementation=eager)")
        return segmented_sdpa(query, key, value, ulysses.segment_ids(kwargs["position_ids"]), dropout, scaling), None
    return chunked_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def long_rows_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   attention_mask=None, local_size=None, use_vmap: bool = False, device="cpu", **kwargs):
    """NAME's mask: transformers' sdpa_mask, except for rows past LONG_ROWS positions whose mask would come
    from their position ids alone (causal, packed examples: no padding mask, sliding window, cache or custom mask
    function): an empty [batch, 1, 0, 0] marker instead of the S x S mask (1 GiB at 32k positions), and `attend`
    takes the examples from the position ids."""
    if (q_length == kv_length > LONG_ROWS and q_offset == kv_offset == 0 and attention_mask is None
            and local_size is None and not use_vmap):
        return torch.ones(batch_size, 1, 0, 0, dtype=torch.bool, device=device)
    return sdpa_mask(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                     attention_mask=attention_mask, local_size=local_size, use_vmap=use_vmap, device=device, **kwargs)


# model.attn_implementation -> the class flag with which transformers says a model supports it.
SUPPORT_FLAGS = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
                 "flex_attention": "_supports_flex_attn"}


def choose(name: str, config) -> tuple[str, str]:
    """(the attention implementation to build the model with, why) for model.attn_implementation=`name`.
    A family whose transformers class does not support `name` (Gemma2: its attention logit softcapping has
    no sdpa form) gets eager, which every family has, rather than transformers' error at build time."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    flag = SUPPORT_FLAGS.get(name)
    if model_class is not None and flag and not getattr(model_class, flag, True):
        return "eager", (f"eager: {model_class.__name__} does not support model.attn_implementation={name} "
                         f"(transformers' {flag} is False)")
    if name == "sdpa":
        return NAME, "sdpa (llmtrain's chunked sdpa for packed rows)"
    return name, f"{name} (model.attn_implementation)"


AttentionInterface.register(NAME, attend)
AttentionMaskInterface.register(NAME, long_rows_mask)
