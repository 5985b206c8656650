"""An offline distillation teacher (distill.teacher_logits): the teacher's top-k next-token log-probs of every
trained token, precomputed once (python -m llmtrain.tools.distill_precompute) and read back by the recipe,
which then loads no teacher.

Indexed by the global sample stream (llmtrain.data.sampling: epoch after epoch of seeded permutations of the
rows; step s of a global batch G takes stream positions s*G .. s*G+G-1), which is the same for any world size,
accumulation split or global batch: a sample's position is its step's first position + its SAMPLE_INDEX.
Per sample, its trained tokens (labels not ignored) in row-major order, as the recipe's loss takes them, each
with k + 1 log-probs (the teacher's k most likely ids, then the log-mass of every other id: the top-k bucket
of llmtrain.losses.distill) and the k ids.

Stored at distill.temperature: the bucket's mass at another temperature is Σ_rest p_j^(1/T) / Z_T, which the
k + 1 stored numbers do not determine, so the temperature is part of what was stored and a run at another
one is refused (as another top_k, vocabulary, data or row order is).

A directory of safetensors shards (one per rank of the precompute: positions [n], offsets [n + 1] into its
tokens, logps [tokens, k + 1] fp32, ids [tokens, k] int32) and manifest.json (what decides the values and a
SHA-256 per shard). Written into a temporary sibling directory and renamed when complete: a directory with a
manifest is whole. Every shard's checksum is verified before any process group, and a damaged shard is
never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import NamedTuple

import torch

from llmtrain.config import ConfigError, DataConfig, to_dict
from llmtrain.run.resume import data_fingerprint
from llmtrain.utils import follow_umask

KEY = "distill.teacher_logits"
MANIFEST = "manifest.json"
VERSION = 1
LOGPS, IDS = "teacher_logps", "teacher_ids"  # the micro-batch keys StoredSource attaches
# Data keys that do not change the training rows or their order (the files are compared by fingerprint).
NOT_ROWS = ("path", "sources", "val_path", "streaming", "shuffle_buffer")


def rows_identity(section: DataConfig, seed: int) -> dict:
    """What decides the training rows and their order besides the files' contents: the data settings (each
    source's format and weight, not its path) and the seed of the sample order."""
    keys = {k: v for k, v in to_dict(section).items() if k not in NOT_ROWS}
    keys["sources"] = [[s.format, s.weight] for s in section.sources or []]
    keys["seed"] = seed
    return keys


def tokens_hash(tokenizer) -> str:
    """The tokenizer's id -> string table, hashed (the stored ids mean these tokens)."""
    table = tokenizer.convert_ids_to_tokens(range(len(tokenizer)))
    return hashlib.sha256(json.dumps(table).encode()).hexdigest()[:16]


class Expected(NamedTuple):
    """What a run needs the stored values to be (the manifest's keys of the same names)."""
    data: str         # resume.data_fingerprint of data's files
    rows: dict        # rows_identity
    vocab: int
    tokens: str       # tokens_hash
    top_k: int
    temperature: float


def expected(section: DataConfig, seed: int, tokenizer, top_k: int, temperature: float) -> Expected:
    return Expected(data_fingerprint(section), rows_identity(section, seed), len(tokenizer), tokens_hash(tokenizer),
                    top_k, temperature)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


AGAIN = "; run python -m llmtrain.tools.distill_precompute with this run's config"
MANIFEST_KEYS = (*Expected._fields, "samples", "shards")  # what check reads besides the version


def read_manifest(directory: str) -> dict:
    root = Path(directory)
    if not root.is_dir():
        raise ConfigError(f"{KEY}: no such directory: {directory}{AGAIN} first")
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{KEY}: {directory} has no {MANIFEST} (not a complete precompute){AGAIN}") from None
    except ValueError as e:
        raise ConfigError(f"{KEY}: {root / MANIFEST} is not valid JSON ({e}){AGAIN}") from None
    if not isinstance(manifest, dict):
        raise ConfigError(f"{KEY}: {root / MANIFEST} holds a JSON {type(manifest).__name__}, not a precompute's "
                          f"manifest (an object){AGAIN}")
    return manifest


def check(directory: str, want: Expected, samples: int) -> dict:
    """The manifest of `directory` if its values are those a run with `want` trains on for `samples` stream
    positions, with every shard present and intact; else a ConfigError naming what differs."""
    root = Path(directory)
    manifest = read_manifest(directory)
    if manifest.get("version") != VERSION:
        raise ConfigError(f"{KEY}: {root / MANIFEST} is version {manifest.get('version')}, this llmtrain reads "
                          f"{VERSION}{AGAIN}")
    if missing := [k for k in MANIFEST_KEYS if k not in manifest]:
        raise ConfigError(f"{KEY}: {root / MANIFEST} lacks {', '.join(missing)} (not a precompute's manifest){AGAIN}")
    if manifest["data"] != want.data:
        raise ConfigError(f"{KEY}: {directory} was computed from other data (fingerprint {manifest['data']}; this "
                          f"run's data files have {want.data}){AGAIN}")
    if manifest["rows"] != want.rows:
        changed = ", ".join(f"{k} {manifest['rows'].get(k)!r} -> {want.rows.get(k)!r}"
                            for k in sorted(set(manifest["rows"]) | set(want.rows))
                            if manifest["rows"].get(k) != want.rows.get(k))
        raise ConfigError(f"{KEY}: {directory} holds other rows or another order (data./train.seed: {changed})"
                          f"{AGAIN}")
    if (manifest["vocab"], manifest["tokens"]) != (want.vocab, want.tokens):
        raise ConfigError(f"{KEY}: {directory} was computed with another tokenizer ({manifest['vocab']} tokens, "
                          f"table {manifest['tokens']}; this run's: {want.vocab}, {want.tokens}){AGAIN}")
    for key in ("top_k", "temperature"):  # neither can be changed afterwards: the top-k bucket holds one sum
        if manifest[key] != getattr(want, key):
            raise ConfigError(f"distill.{key}: {getattr(want, key):g}, but {directory} was computed with "
                              f"{key} {manifest[key]:g}: set distill.{key}={manifest[key]:g} or precompute again")
    if manifest["samples"] < samples:
        raise ConfigError(f"{KEY}: {directory} holds {manifest['samples']} samples of the stream, this run trains "
                          f"on {samples} (train.max_steps x the global batch); precompute again with --samples "
                          f"{samples}")
    for shard in manifest["shards"]:
        path = root / shard["file"]
        if not path.is_file():
            raise ConfigError(f"{KEY}: {path} is missing{AGAIN}")
        if file_sha256(path) != shard["sha256"]:
            raise ConfigError(f"{KEY}: {path} is damaged (its SHA-256 is not the manifest's); not loaded{AGAIN}")
    return manifest


class Store:
    """Every stored sample's values, looked up by stream position."""

    def __init__(self, directory: str, manifest: dict):
        from safetensors.torch import load_file

        shards = [load_file(Path(directory) / s["file"]) for s in manifest["shards"]]
        n = manifest["samples"]
        self.start = torch.full((n,), -1, dtype=torch.long)  # a position's first token in the concatenation
        self.count = torch.zeros(n, dtype=torch.long)
        base = 0
        for s in shards:
            keep = s["positions"] < n  # the precompute's last step may run past the samples it was asked for
            self.start[s["positions"][keep]] = s["offsets"][:-1][keep] + base
            self.count[s["positions"][keep]] = s["offsets"].diff()[keep]
            base += len(s["logps"])
        self.logps = torch.cat([s["logps"] for s in shards])
        self.ids = torch.cat([s["ids"] for s in shards])
        self.top_k = manifest["top_k"]

    def take(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored log-probs [tokens, k + 1] and ids [tokens, k] (int64) of these samples' trained tokens,
        in order."""
        if len(positions) and (int(positions.max()) >= len(self.start) or (self.start[positions] < 0).any()):
            raise ConfigError(f"{KEY}: stream positions {positions.tolist()} are not all stored")
        rows = torch.cat([torch.arange(a, a + c) for a, c in zip(self.start[positions].tolist(),
                                                                 self.count[positions].tolist())])
        return self.logps[rows], self.ids[rows].long()


class Shard:
    """One rank's share, gathered sample by sample (add) and written once (write)."""

    def __init__(self):
        self.positions, self.counts, self.logps, self.ids = [], [], [], []

    def add(self, positions: torch.Tensor, counts: torch.Tensor, logps: torch.Tensor, ids: torch.Tensor) -> None:
        """Samples at stream `positions` with `counts` trained tokens each; their tokens' rows, in order."""
        self.positions.append(positions.cpu())
        self.counts.append(counts.cpu())
        self.logps.append(logps.float().cpu())
        self.ids.append(ids.int().cpu())

    def write(self, path: Path, top_k: int) -> dict:
        """The shard file (fsynced) and its manifest entry."""
        from safetensors.torch import save_file

        counts = torch.cat(self.counts) if self.counts else torch.zeros(0, dtype=torch.long)
        tensors = {"positions": torch.cat(self.positions) if self.positions else torch.zeros(0, dtype=torch.long),
                   "offsets": torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]),
                   "logps": torch.cat(self.logps) if self.logps else torch.zeros(0, top_k + 1),
                   "ids": torch.cat(self.ids) if self.ids else torch.zeros(0, top_k, dtype=torch.int32)}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        follow_umask(path)
        _fsync(path)
        return {"file": path.name, "sha256": file_sha256(path), "samples": len(tensors["positions"]),
                "tokens": len(tensors["logps"])}


def partial_dir(out: Path) -> Path:
    """Where a precompute writes before its rename to `out` (a sibling: the same file system)."""
    return out.with_name(f".{out.name}.partial")


def publish(out: Path, manifest: dict) -> None:
    """Rank 0, once every shard is in partial_dir(out): the manifest, then the rename that makes it whole."""
    tmp = partial_dir(out)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync(tmp / MANIFEST)
    os.replace(tmp, out)


def fresh_partial(out: Path) -> Path:
    """Rank 0, before any shard: an empty partial_dir(out) (what an interrupted precompute left is dropped)."""
    tmp = partial_dir(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())
