"""Distillation's teacher side (llmtrain.recipes.distill.objective's KDObjective asks it for the teacher's
distributions, TeacherSide): the teacher model (LiveTeacher: llmtrain.train.frozen's frozen model, its forward run
inside the student's) or its stored top-k log-probs (StoredTeacher, distill.teacher_logits), which StoredSource
attaches to each micro-batch; and the stored values' format, written by python -m llmtrain.tools.distill_precompute
(Shard, write_manifest) and read back here (check, Store), so the recipe loads no teacher.

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
tokens, logps [tokens, k + 1] fp32, ids [tokens, k] int32) and manifest.json (what decides the values and the
content hash of each shard, llmtrain.utils.content_hash). Written into a temporary sibling directory and
published whole (llmtrain.utils.publish): a directory with a manifest is complete. Every shard's hash is verified
before any process group, and a damaged shard is never loaded. A store of an earlier version (1: SHA-256) is
refused in one line that says to precompute again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, NamedTuple, Protocol

import torch

from llmtrain import data
from llmtrain.config import ConfigError, DataConfig, ModelConfig, to_dict
from llmtrain.losses import distill as kd
from llmtrain.losses.token import trained_tokens
from llmtrain.models import hf, ulysses
from llmtrain.run.resume import data_fingerprint
from llmtrain.train import frozen
from llmtrain.train.build import Run
from llmtrain.train.source import Batch, BatchSource, DerivedSource
from llmtrain.utils import HASH, content_hash, follow_umask, publish

KEY = "distill.teacher_logits"
MANIFEST = "manifest.json"
VERSION = 2  # 2: content_hash (xxh3_64) of the shards and the token table; 1: SHA-256
LOGPS, IDS = "teacher_logps", "teacher_ids"  # the micro-batch keys StoredSource attaches
# Data keys that do not change the training rows or their order (the files are compared by fingerprint).
NOT_ROWS = ("path", "sources", "val_path", "streaming", "shuffle_buffer")


TeacherDist = Callable[[slice], kd.Dist]  # rows of the micro-batch's trained tokens -> the teacher's Dist of them


class TeacherSide(Protocol):
    """What KDObjective asks of the teacher: `dists(batch, use)` calls use(dist), dist(rows) -> the teacher's
    Dist (llmtrain.losses.distill) of those rows of the batch's trained tokens (in the student's row-major
    order); `evaluates`: whether it also gives the validation rows' KD and its own loss."""
    evaluates: bool

    def dists(self, batch: dict, use: Callable[[TeacherDist], None]) -> None: ...


class LiveTeacher:
    """The teacher model (a FrozenModel): `dists` runs its forward and calls use() inside it, where its final
    hidden states of the trained positions give each chunk's logits on demand (vocab: the ids compared; the
    models' embeddings may be padded beyond them)."""
    evaluates = True

    def __init__(self, model: frozen.FrozenModel, vocab: int, temperature: float, top_k: int):
        self.frozen, self.vocab, self.temperature, self.top_k = model, vocab, temperature, top_k

    @classmethod
    def beside_student(cls, run: Run, path: str, dtype: torch.dtype, temperature: float, top_k: int) -> LiveTeacher:
        """The teacher at `path`, frozen next to the student and sharded on its mesh, computing in `dtype`."""
        model = frozen.beside_policy(run, *teacher_source(path, run.cfg.model), "teacher", dtype, "chunked")
        return cls(model, len(run.tokenizer), temperature, top_k)

    def describe(self, path: str) -> str:
        return f"distill: teacher {path} ({self.frozen.describe()})"

    def dists(self, batch: dict, use: Callable[[TeacherDist], None]) -> None:
        def inside(hidden, _targets):
            def dist(rows):
                logits = self.frozen.forward(lambda _, token_loss: token_loss.head_logits(hidden[rows]))
                return kd.teacher_dist(logits, self.vocab, self.temperature, self.top_k)

            use(dist)
            return hidden.new_zeros(())  # nothing differentiable leaves the teacher's forward

        self.frozen.forward(lambda model, token_loss: token_loss.on_trained_rows(model, batch, inside))


def teacher_source(path: str, student: ModelConfig) -> tuple[ModelConfig, object]:
    """The teacher at `path` as a model section (with the student's attention kernel), and its config."""
    tokenizer = hf.load_tokenizer(path, student.trust_remote_code)
    source = ModelConfig(path=path, attn_implementation=student.attn_implementation)
    return source, hf.load_model_config(source, tokenizer)


class StoredTeacher:
    """The offline teacher: the top-k log-probs StoredSource attached to the micro-batch (no model, so no
    validation KD: its rows were not precomputed)."""
    evaluates = False

    def dists(self, batch: dict, use: Callable[[TeacherDist], None]) -> None:
        # Stored for the whole rows' trained tokens: a sequence split's slice takes its own (called in the forward)
        logps, ids = ulysses.own_tokens(batch[LOGPS]), ulysses.own_tokens(batch[IDS])
        use(lambda rows: kd.Dist(logps[rows], ids[rows]))


class StoredSource(DerivedSource):
    """The data's micro-batches (a BatchSource), each with its samples' stored teacher values attached (LOGPS,
    IDS), looked up by stream position: the step's first position (samples seen before it) + SAMPLE_INDEX."""

    def __init__(self, inner: BatchSource, store: Store):
        super().__init__(inner)
        self.store = store

    def next(self) -> Batch:
        first = self.inner.position()["samples_seen"]
        batch = self.inner.next()
        micro = []
        for b in batch.micro:
            logps, ids = self.store.take(first + b[data.SAMPLE_INDEX])
            if len(logps) != int(trained_tokens(b["labels"])):  # the same rows, or the store is not this data's
                raise ConfigError(f"{KEY}: the stored values of stream positions {first} + "
                                  f"{b[data.SAMPLE_INDEX].tolist()} have {len(logps)} tokens, the batch trains "
                                  f"{int(trained_tokens(b['labels']))}; precompute again with this config")
            micro.append({**b, LOGPS: logps, IDS: ids})
        return batch._replace(micro=micro)


def rows_identity(section: DataConfig, seed: int) -> dict:
    """What decides the training rows and their order besides the files' contents: the data settings (each
    source's format and weight, not its path) and the seed of the sample order."""
    keys = {k: v for k, v in to_dict(section).items() if k not in NOT_ROWS}
    keys["sources"] = [[s.format, s.weight] for s in section.sources or []]
    keys["seed"] = seed
    return keys


def tokens_hash(tokenizer) -> str:
    """The tokenizer's id -> string table, hashed (the stored ids mean these tokens)."""
    return content_hash(json.dumps(tokenizer.convert_ids_to_tokens(range(len(tokenizer)))).encode())


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
        if content_hash(path) != shard[HASH]:
            raise ConfigError(f"{KEY}: {path} is damaged (its {HASH} is not the manifest's); not loaded{AGAIN}")
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
        """The shard file and its manifest entry."""
        from safetensors.torch import save_file

        counts = torch.cat(self.counts) if self.counts else torch.zeros(0, dtype=torch.long)
        tensors = {"positions": torch.cat(self.positions) if self.positions else torch.zeros(0, dtype=torch.long),
                   "offsets": torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]),
                   "logps": torch.cat(self.logps) if self.logps else torch.zeros(0, top_k + 1),
                   "ids": torch.cat(self.ids) if self.ids else torch.zeros(0, top_k, dtype=torch.int32)}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        follow_umask(path)
        return {"file": path.name, HASH: content_hash(path), "samples": len(tensors["positions"]),
                "tokens": len(tensors["logps"])}


def partial_dir(out: Path) -> Path:
    """Where a precompute writes before its rename to `out` (a sibling: the same file system)."""
    return out.with_name(f".{out.name}.partial")


def write_manifest(out: Path, manifest: dict) -> None:
    """Rank 0, once every shard is in partial_dir(out): the manifest, then the publish that makes it whole."""
    tmp = partial_dir(out)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    publish(tmp, out)


def fresh_partial(out: Path) -> Path:
    """Rank 0, before any shard: an empty partial_dir(out) (what an interrupted precompute left is dropped)."""
    tmp = partial_dir(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp
