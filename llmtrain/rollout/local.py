"""Sampling completions for a batch of prompts inside a training run, under any parallel strategy.

Reproducible by key: each completion draws its random numbers from its own torch.Generator, seeded from
a key such as (seed, step, prompt index in the dataset, generation index) (sample_seed), and samples by
inverse CDF (one uniform per token), so a completion depends on its key, its prompt and the weights only:
not on the world size, the rank, the other rows of its batch, the micro-batch split or a resume. (Its
logits may differ in the last bits between batch layouts; a token flips only when a uniform falls
within that distance of a boundary of the cumulative distribution.)

One gather of the weights per call (the strategy's: parallelize.Strategy.unsharded), a KV cache for
decoding: none, ddp and fsdp2 decode on the gathered module without a collective, so ranks stop at their own
last token; under fsdp each forward is still collective (lockstep), so every rank runs the same number of
forwards (a finished rank feeds padding) until every rank is done, agreed by a one-int all-reduce per step.

Rows: prompts left-padded with an attention mask. A row that samples an EOS leaves the batch (its rows
of the input, attention mask, positions and KV cache are dropped; compaction), so each forward costs what
the rows still sampling cost; every row's tokens go to its own slot of the output. The completions are
the same as without compaction (compact=False: finished rows decode padding to the end), since a row's
uniforms do not depend on the others. In lockstep (FSDP1) a rank with no row left feeds one padding row.
"""

from __future__ import annotations

import hashlib
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmtrain.parallelize import unsharded as gathered  # (module to call, lockstep): the strategy's gather
from llmtrain.rollout.engine import Completions, EngineSetup, Sampling
from llmtrain.rollout.section import RolloutSection


class CompletionGrid(NamedTuple):
    """The keyed sampler's completions as a padded grid (an Engine's Completions: as_completions)."""
    ids: torch.Tensor        # [rows, width] long: sampled tokens, pad_id after a row's first EOS
    mask: torch.Tensor       # [rows, width] bool: the completion's tokens, its first EOS included
    lengths: torch.Tensor    # [rows] long: mask.sum(1)
    truncated: torch.Tensor  # [rows] bool: max_tokens reached without an EOS
    logps: torch.Tensor | None = None  # [rows, width] float32: each token's log-prob under the distribution it
                                       # was sampled from (logits / temperature, top-k / top-p filtered); 0 elsewhere


def sample_seed(*key: int) -> int:
    """A 63-bit generator seed from integers (e.g. seed, step, prompt index, generation index): a hash, so
    that nearby keys give unrelated streams."""
    digest = hashlib.blake2b(b",".join(str(int(k)).encode() for k in key), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def uniforms(keys: list[tuple[int, ...]], n: int) -> torch.Tensor:
    """[rows, n] float64 uniforms in [0, 1), row i from a CPU generator seeded by sample_seed(*keys[i]):
    the same on any device."""
    out = torch.empty(len(keys), n, dtype=torch.float64)
    for i, key in enumerate(keys):
        out[i] = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(sample_seed(*key)))
    return out


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' TopKLogitsWarper then TopPLogitsWarper (at least one token kept): excluded tokens get
    -inf. logits: [rows, vocab], already divided by the temperature."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p
        drop[:, -1] = False
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


def pick(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row by inverse CDF: the first token whose cumulative probability exceeds u (right=True
    never picks a token of probability 0)."""
    cdf = logits.float().softmax(-1).double().cumsum(-1)
    token = torch.searchsorted(cdf, (u.to(cdf.device) * cdf[:, -1])[:, None], right=True)
    return token.squeeze(1).clamp(max=logits.shape[-1] - 1)


@torch.no_grad()
def generate(model: nn.Module, prompts: list[list[int]], keys: list[tuple[int, ...]], sampling: Sampling,
             eos_ids: list[int], pad_id: int, device: torch.device, compact: bool = True) -> CompletionGrid:
    """Sample one completion per prompt (repeat a prompt G times with G keys for a group). Collective
    under FSDP1 and FSDP2: every rank calls it, each with its own prompts (at least one). Run it under the
    training's autocast when it has one. compact: finished rows leave the batch (False: they decode padding
    to the end, for comparison; the same completions)."""
    if not prompts or len(prompts) != len(keys):
        raise ValueError(f"generate: {len(prompts)} prompts and {len(keys)} keys; need as many, at least one")
    decoding = Decoding(prompts, keys, sampling, eos_ids, pad_id, device)
    was_training = model.training
    model.eval()
    try:
        with gathered(model) as (module, lockstep):
            while decoding.step < sampling.max_tokens:
                stopped = decoding.sample_next(module)
                if _all_done(decoding.running, lockstep, device):
                    break
                if compact and stopped.any():
                    decoding.drop_finished()
                decoding.feed_back()
    finally:
        model.train(was_training)
    return decoding.result()


class Decoding:
    """The state of one generate call: the batch's rows (left-padded prompts, then one sampled token per forward)
    and the output slots. live[j] is the slot (prompt index) of row j of the batch, running[j] whether it still
    samples; out / logps hold every slot's tokens and their log-probs."""

    def __init__(self, prompts: list[list[int]], keys: list[tuple[int, ...]], sampling: Sampling,
                 eos_ids: list[int], pad_id: int, device: torch.device):
        rows, width = len(prompts), max(map(len, prompts))
        ids = torch.full((rows, width), pad_id, dtype=torch.long)
        attention = torch.zeros(rows, width, dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row's next token is at the same position
            ids[i, width - len(p):] = torch.tensor(p)
            attention[i, width - len(p):] = 1
        self.inputs, self.attention = ids.to(device), attention.to(device)
        self.positions = (self.attention.cumsum(1) - 1).clamp(min=0)
        self.sampling, self.pad, self.device = sampling, pad_id, device
        self.u = uniforms(keys, sampling.max_tokens).to(device)
        self.eos = torch.tensor(sorted(set(eos_ids)), device=device)
        self.out = torch.full((rows, sampling.max_tokens), pad_id, dtype=torch.long, device=device)
        self.logps = torch.zeros(rows, sampling.max_tokens, device=device)
        self.ended = torch.zeros(rows, dtype=torch.bool, device=device)  # an EOS was sampled
        self.live = torch.arange(rows, device=device)
        self.running = torch.ones(rows, dtype=torch.bool, device=device)
        self.cache, self.step, self.token = None, 0, None

    def sample_next(self, module: nn.Module) -> torch.Tensor:
        """One forward, one token per running row into its slot -> the rows that sampled an EOS."""
        s = self.sampling
        result = module(input_ids=self.inputs, attention_mask=self.attention, position_ids=self.positions,
                        cache=self.cache, use_cache=True, logits_to_keep=1)
        self.cache = result.cache
        logits = filter_logits(result.logits[:, -1].float() / s.temperature, s.top_k, s.top_p)
        running = self.running
        token = pick(logits, self.u[self.live, self.step]).masked_fill(~running, self.pad)
        slots = self.live[running]
        self.out[slots, self.step] = token[running]
        self.logps[slots, self.step] = logits[running].log_softmax(-1).gather(1, token[running, None]).squeeze(1)
        stopped = running & torch.isin(token, self.eos)
        self.ended[self.live[stopped]] = True
        self.running = running & ~stopped
        self.step += 1
        self.token = token
        return stopped

    def drop_finished(self) -> None:
        """Compaction: only the rows still sampling stay in the batch (in lockstep at least one: a rank with none
        left feeds one padding row, so that it runs as many forwards as the others)."""
        running = self.running
        keep = running.nonzero().squeeze(1) if running.any() else running.new_zeros(1, dtype=torch.long)
        self.cache.batch_select_indices(keep)
        self.live, self.running, self.token = self.live[keep], running[keep], self.token[keep]
        self.attention, self.positions = self.attention[keep], self.positions[keep]

    def feed_back(self) -> None:
        """The sampled tokens are the next forward's inputs, one position on."""
        self.inputs = self.token[:, None]
        self.attention = F.pad(self.attention, (0, 1), value=1)
        self.positions = self.positions[:, -1:] + 1

    def result(self) -> CompletionGrid:
        """Each slot's tokens up to and including its first EOS (all of them when it has none)."""
        step, device = self.step, self.device
        out, logps = self.out[:, :step], self.logps[:, :step]
        first_eos = torch.where(torch.isin(out, self.eos), torch.arange(step, device=device), step).amin(1)
        mask = torch.arange(step, device=device)[None] <= first_eos[:, None]
        out = out.masked_fill(~mask, self.pad)
        return CompletionGrid(out, mask, mask.sum(1), ~self.ended, logps.masked_fill(~mask, 0.0))


def from_lists(tokens: list[list[int]], truncated: list[bool], pad_id: int) -> CompletionGrid:
    """A CompletionGrid from each row's tokens (its first EOS included) and truncation, as a checkpoint holds them."""
    width = max(1, max(map(len, tokens)))
    ids = torch.full((len(tokens), width), pad_id, dtype=torch.long)
    for i, row in enumerate(tokens):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    lengths = torch.tensor([len(row) for row in tokens])
    return CompletionGrid(ids, torch.arange(width)[None] < lengths[:, None], lengths, torch.tensor(truncated))


def _all_done(running: torch.Tensor, lockstep: bool, device: torch.device) -> bool:
    """No row of this rank still sampling; in lockstep, of any rank (one all-reduce)."""
    if not lockstep:
        return not bool(running.any())
    pending = running.any().long().reshape(1).to(device)
    dist.all_reduce(pending)
    return not pending.item()


def as_completions(grid: CompletionGrid, seconds: float) -> Completions:
    """An engine's Completions from a CompletionGrid with log-probs."""
    lengths = grid.lengths.tolist()
    return Completions([r[:n] for r, n in zip(grid.ids.tolist(), lengths)], grid.truncated.tolist(),
                       [r[:n] for r, n in zip(grid.logps.tolist(), lengths)], seconds)


class LocalEngine:
    """rollout.engine=local: the keyed sampler (generate) on the training model, in the training processes."""
    copies_weights, weights_dtype = False, None

    def __init__(self, section: RolloutSection, setup: EngineSetup):
        self.model, self.autocast = setup.model, setup.autocast
        self.eos, self.pad, self.device = setup.eos_ids, setup.pad_id, setup.device

    def generate(self, prompt_ids, keys, sampling) -> Completions:
        t0 = time.perf_counter()
        with self.autocast():
            out = generate(self.model, prompt_ids, keys, sampling, self.eos, self.pad, self.device)
        return as_completions(out, time.perf_counter() - t0)

    def update_weights(self, step: int, full: dict[str, torch.Tensor]) -> None:
        """Samples from the training model itself: its weights are always the policy's."""
