"""llmtrain.recipes.distill.teacher, the offline teacher's store: shards written by ranks read back by stream position
(tokens in order, whichever shard holds a sample); the directory appears whole (manifest, then the rename);
each way a store can be another run's (data, rows, tokenizer, top_k, temperature, too few samples) or damaged
(no manifest, a missing shard, a changed byte) is a one-line ConfigError naming it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from llmtrain.recipes.distill import teacher as stored
from llmtrain.config import ConfigError, DataConfig

K = 3
WANT = stored.Expected("d" * 16, stored.rows_identity(DataConfig(path="x.jsonl"), 7), 50, "t" * 16, K, 1.5)


def sample_values(position: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct values per (position, token): what a sample's rows must read back as."""
    logps = torch.arange(count * (K + 1), dtype=torch.float32).view(count, K + 1) + 1000 * position
    ids = torch.arange(count * K, dtype=torch.int32).view(count, K) + 100 * position
    return logps, ids


def write_store(root, world=2, samples=10):
    """`world` ranks' shards of stream positions 0..samples+1 (rank r: r, r + world, ...; the last step past
    `samples`), 2 micro-batches each, sample p with p % 4 trained tokens (0 included)."""
    out = root / "store"
    tmp = stored.fresh_partial(out)
    entries = []
    for rank in range(world):
        shard = stored.Shard()
        mine = list(range(rank, samples + 2, world))
        for part in (mine[: len(mine) // 2], mine[len(mine) // 2:]):
            counts = torch.tensor([p % 4 for p in part])
            values = [sample_values(p, p % 4) for p in part]
            shard.add(torch.tensor(part), counts, torch.cat([v[0] for v in values]), torch.cat([v[1] for v in values]))
        entries.append(shard.write(tmp / f"rank{rank:05d}.safetensors", K))
    assert not out.exists()  # nothing at the final name before publish
    stored.write_manifest(out, {"version": stored.VERSION, **WANT._asdict(), "samples": samples, "shards": entries})
    assert not stored.partial_dir(out).exists()
    return out


def test_stored_values_read_back_by_stream_position(tmp_path):
    out = write_store(tmp_path)
    store = stored.Store(str(out), stored.check(str(out), WANT, 10))
    positions = torch.tensor([7, 2, 3, 4, 9])  # across both shards, one with no trained token (4)
    logps, ids = store.take(positions)
    want = [sample_values(p, p % 4) for p in positions.tolist()]
    assert torch.equal(logps, torch.cat([w[0] for w in want]))
    assert torch.equal(ids, torch.cat([w[1] for w in want]).long()) and ids.dtype == torch.long
    with pytest.raises(ConfigError, match="not all stored"):
        store.take(torch.tensor([10]))  # computed past `samples`, but not part of the store


@pytest.mark.parametrize("field, value, message", [
    ("data", "e" * 16, f"was computed from other data (fingerprint {'e' * 16}; this run's data files have "
                       f"{'d' * 16}); run python -m llmtrain.tools.distill_precompute"),
    ("rows", {**WANT.rows, "seq_len": 128}, "other rows or another order (data./train.seed: seq_len 128 -> 256)"),
    ("vocab", 51, "another tokenizer (51 tokens"),
    ("tokens", "u" * 16, "another tokenizer"),
    ("top_k", 5, "distill.top_k: 3, but"),
    ("temperature", 1.0, "distill.temperature: 1.5, but"),
    ("samples", 8, "holds 8 samples of the stream, this run trains on 10"),
    ("version", 0, "is version 0"),
])
def test_another_runs_store_is_refused_naming_what_differs(tmp_path, field, value, message):
    out = write_store(tmp_path)
    manifest = json.loads((out / stored.MANIFEST).read_text())
    (out / stored.MANIFEST).write_text(json.dumps({**manifest, field: value}))
    with pytest.raises(ConfigError) as e:
        stored.check(str(out), WANT, 10)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_damaged_or_incomplete_store_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="distill.teacher_logits: no such directory"):
        stored.check(str(tmp_path / "nowhere"), WANT, 10)
    out = write_store(tmp_path)
    shard = out / "rank00001.safetensors"
    good = shard.read_bytes()
    shard.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(ConfigError, match=r"rank00001.safetensors is damaged \(its xxh3_64"):
        stored.check(str(out), WANT, 10)
    shard.unlink()
    with pytest.raises(ConfigError, match="rank00001.safetensors is missing"):
        stored.check(str(out), WANT, 10)
    partial = tmp_path / "partial"
    shutil.copytree(out, partial)
    (partial / stored.MANIFEST).unlink()
    with pytest.raises(ConfigError, match="has no manifest.json"):
        stored.check(str(partial), WANT, 10)


def test_rows_identity_leaves_out_paths_and_keeps_the_order_seed():
    a = stored.rows_identity(DataConfig(path="a.jsonl", val_path="v.jsonl"), 7)
    assert a == stored.rows_identity(DataConfig(path="elsewhere/a.jsonl"), 7)
    assert a != stored.rows_identity(DataConfig(path="a.jsonl"), 8)
    assert a != stored.rows_identity(DataConfig(path="a.jsonl", packing=False), 7)
