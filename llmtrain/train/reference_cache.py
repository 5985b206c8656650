"""Precomputed reference log-probs (dpo.precompute_reference, kto.precompute_reference): one pass of the
reference over every training row before the first step stores its summed log-probs (DPO: each pair's chosen
and rejected rows; KTO: each row's completion and its KL row's), indexed by the row's position in the
tokenized data (the batches' pair_index); training then looks them up and holds no reference model. The
position, not the order of the pass, is the index: any world size, accumulation split or resume reads the
right value.

Cache: reference-logps-<key>/ next to the tokenized pairs (the datasets cache files; output_dir when the
pairs are not on disk), key = a hash of what decides the values (the reference's weights, the tokenized
data's datasets fingerprint, seq_len, compute dtype), so a later run with the same ones reuses it. The pass
is cut into pieces of PIECE pairs; rank 0 writes each piece as one file (utils.publish: a file is whole or
absent) holding the content hash of its values (utils.content_hash), and reads them back for every rank (a node that
does not see the cache still gets them). A missing or corrupt piece is computed again: an interrupted pass
continues where it stopped, and a damaged file is never used. A cache an llmtrain with another content hash
wrote (SHA-256 until 2026-12) has another key, so it is not found: the pass runs again, and says so.
"""

from __future__ import annotations

import gc
import json
import math
import os
import time
from pathlib import Path
from typing import Callable

import torch

from llmtrain import distributed
from llmtrain.models import ulysses
from llmtrain.utils import HASH, content_hash, publish, release_freed_memory

PIECE = 256  # pairs per file: what an interrupted pass loses at most
Scorer = Callable[[dict], torch.Tensor]  # batch -> the reference's summed log-prob per row (chosen, then rejected)


def directory(rows, fallback: Path, **key: object) -> Path:
    """Where the log-probs of `rows` (the tokenized pairs, a datasets.Dataset) for `key` are cached."""
    key["data"] = rows._fingerprint  # datasets' hash of the files and of every transform that made the rows
    name = "reference-logps-" + content_hash(json.dumps(key, sort_keys=True).encode())
    files = rows.cache_files
    return (Path(files[0]["filename"]).parent if files else fallback) / name


class Table:
    """The precomputed values, looked up by a batch's pair_index: a Scorer with no model."""

    def __init__(self, values: torch.Tensor):
        self.values = values  # [pairs, 2]: chosen, rejected

    def __call__(self, batch: dict) -> torch.Tensor:
        chosen, rejected = self.values[batch["pair_index"]].unbind(1)
        return torch.cat([chosen, rejected])


def precompute(where: Path, n_pairs: int, batch_of: Callable[[list[int]], dict], micro: int,
               make_scorer: Callable[[], Scorer], env: distributed.DistEnv, info: Callable[[str], None]) -> Table:
    """The reference's log-probs of pairs 0..n_pairs-1 (batch_of(positions) collates them), read from the
    cache at `where` or computed: make_scorer() is called (e.g. builds the reference) only if a piece is
    missing, and what it returns is freed before this returns. Collective: every rank calls it."""
    values = torch.zeros(n_pairs, 2, device=env.device)
    pieces = [(a, min(a + PIECE, n_pairs)) for a in range(0, n_pairs, PIECE)]
    have = torch.zeros(len(pieces), device=env.device)
    if env.is_main:
        for i, (a, b) in enumerate(pieces):
            got = _read(where / _name(a, b), b - a, info)
            if got is not None:
                values[a:b], have[i] = got, 1
    distributed.all_reduce(values)  # rank 0's reads to every rank (the others add zeros)
    missing = [p for p, done in zip(pieces, distributed.all_reduce(have).tolist()) if not done]
    if not missing:
        info(f"reference log-probs: reused {where} ({n_pairs} pairs)")
        return Table(values)
    t0 = time.perf_counter()
    save = env.is_main and _try(lambda: where.mkdir(parents=True, exist_ok=True), where, info)
    score = make_scorer()
    for a, b in missing:
        part = torch.zeros(b - a, 2, device=env.device)
        # A sequence group's ranks score the same pairs (each its slice of the rows), counted once.
        mine = list(range(a + env.dp_rank, b, env.dp_size))
        # Every rank runs as many forwards as the busiest (FSDP's are collectives); an idle one scores pair a.
        for j in range(0, math.ceil((b - a) / (env.dp_size * micro)) * micro, micro):
            positions = mine[j:j + micro]
            batch = {k: v.to(env.device) for k, v in batch_of(positions or [a]).items()}
            logps = score(batch).float().view(2, -1)
            if positions:
                part[torch.tensor(positions, device=env.device) - a] = logps.T
        values[a:b] = distributed.all_reduce(ulysses.once(env.sp_group, part))
        save = save and _try(lambda: _write(where / _name(a, b), values[a:b].cpu()), where, info)
    del score  # the reference (a frozen copy) goes with it, before the optimizer state exists
    gc.collect()
    release_freed_memory()
    computed = sum(b - a for a, b in missing)
    info(f"reference log-probs: computed {computed} pairs in {time.perf_counter() - t0:.1f} s"
         + (f" ({n_pairs - computed} reused)" if computed < n_pairs else "")
         + (f", cached in {where}" if save else ""))
    return Table(values)


def _name(start: int, stop: int) -> str:
    return f"pairs-{start:09d}-{stop:09d}.pt"


def _digest(values: torch.Tensor) -> str:
    return content_hash(values.contiguous().numpy().tobytes())


def _read(path: Path, n: int, info: Callable[[str], None]) -> torch.Tensor | None:
    """A piece's values, or None when it is absent or not exactly what _write wrote (said, then recomputed)."""
    if not path.is_file():
        return None
    try:
        saved = torch.load(path, weights_only=True)
        values = saved["values"]
        ok = (values.shape == (n, 2) and values.dtype == torch.float32 and _digest(values) == saved[HASH])
    except Exception as e:  # a truncated or overwritten file: whatever torch.load raises, it is not used
        ok, why = False, f"{type(e).__name__}: {e}".splitlines()[0]
    else:
        why = "its values do not match their checksum"
    if not ok:
        info(f"reference log-probs: {path} is damaged ({why}); computing it again")
        return None
    return values


def _try(write: Callable[[], None], where: Path, info: Callable[[str], None]) -> bool:
    """A cache that cannot be written (read-only, full) costs a later run this pass again, not this run."""
    try:
        write()
        return True
    except OSError as e:
        info(f"reference log-probs: cannot write {where} ({e}); not cached, computed again next run")
        return False


def _write(path: Path, values: torch.Tensor) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # unique: two runs may fill one cache at once
    torch.save({"values": values, HASH: _digest(values)}, tmp)
    publish(tmp, path)
