"""Data: files -> datasets -> token rows (input_ids, labels, position_ids) -> a sampler whose global
order does not depend on the world size or the accumulation split."""

from __future__ import annotations

import glob
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from llmtrain.config import ConfigError, DataConfig

IGNORE = -100
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
PACK_BATCH = 1000  # documents packed together; the last row of each batch is padded


def resolve_files(path: str) -> list[str]:
    """A file, a glob or a directory -> sorted data files of one known type."""
    p = Path(path)
    if p.is_dir():
        files = sorted(str(f) for f in p.rglob("*") if f.is_file() and f.suffix in BUILDERS)
    else:
        files = sorted(glob.glob(path, recursive=True))
    if not files:
        raise ConfigError(f"data.path: nothing matches {path!r}")
    suffixes = {Path(f).suffix for f in files}
    unknown = suffixes - set(BUILDERS)
    if unknown:
        raise ConfigError(f"data.path: unsupported file type {sorted(unknown)}; use one of {sorted(BUILDERS)}")
    if len(suffixes) > 1:
        raise ConfigError(f"data.path: mixes file types {sorted(suffixes)}; point it at one type")
    return files


def load_documents(section: DataConfig):
    from datasets import load_dataset

    files = resolve_files(section.path)
    ds = load_dataset(BUILDERS[Path(files[0]).suffix], data_files=files, split="train")
    if section.text_field not in ds.column_names:
        raise ConfigError(f"data.text_field: {files[0]} has no field {section.text_field!r}; "
                          f"its fields are {ds.column_names}")
    return ds


def pack_rows(docs: list[list[int]], seq_len: int, pad_id: int) -> dict[str, list[list[int]]]:
    """Concatenate documents and cut rows of seq_len. position_ids restart at every document, so
    transformers masks attention block-causally and each document sees only itself; the first token
    of each document piece gets no label (nothing before it in its own document predicts it)."""
    ids, labels, pos = [], [], []
    rows: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}

    def flush() -> None:
        n = seq_len - len(ids)
        rows["input_ids"].append(ids + [pad_id] * n)
        rows["labels"].append(labels + [IGNORE] * n)
        rows["position_ids"].append(pos + list(range(n)))  # pads form their own (ignored) segment
        ids.clear(), labels.clear(), pos.clear()

    for doc in docs:
        start = 0
        while start < len(doc):
            piece = doc[start:start + seq_len - len(ids)]
            ids.extend(piece)
            labels.extend([IGNORE] + piece[1:])
            pos.extend(range(len(piece)))
            start += len(piece)
            if len(ids) == seq_len:
                flush()
    if ids:
        flush()
    return rows


def pad_rows(docs: list[list[int]], seq_len: int, pad_id: int) -> dict[str, list[list[int]]]:
    """One document per row, truncated to seq_len and right-padded (pads come after, so real tokens
    never attend to them under the causal mask)."""
    rows: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}
    for doc in docs:
        doc = doc[:seq_len]
        n = seq_len - len(doc)
        rows["input_ids"].append(doc + [pad_id] * n)
        rows["labels"].append([IGNORE] + doc[1:] + [IGNORE] * n)
        rows["position_ids"].append(list(range(seq_len)))
    return rows


def build_dataset(section: DataConfig, tokenizer, is_main: bool):
    """Tokenize and pack with datasets.map (cached by fingerprint). Rank 0 builds the cache while the
    others wait at a barrier, then they read it instead of tokenizing again."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    def tokenize(batch):
        texts = [t for t in batch[section.text_field] if isinstance(t, str) and t]
        docs = [ids + [eos] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        fn = pack_rows if section.packing else pad_rows
        return fn(docs, section.seq_len, pad)

    def run():
        ds = load_documents(section)
        return ds.map(tokenize, batched=True, batch_size=PACK_BATCH, remove_columns=ds.column_names,
                      desc="tokenize+pack" if section.packing else "tokenize")

    if not is_main:
        dist.barrier()
    ds = run()
    if is_main:
        dist.barrier()
    if len(ds) == 0:
        raise ConfigError(f"data.path: {section.path} yields no tokens (empty or all records empty)")
    return ds.with_format("torch")


class GlobalOrderSampler(DistributedSampler):
    """DistributedSampler whose global order ignores the world size: epoch e is the permutation seeded
    by (seed, e), cut to whole global batches; rank r takes every world-th index of it. The global
    batch of step k is then one fixed set of samples whatever the world size and accumulation split,
    and the data position is a single number: the step."""

    def __init__(self, dataset, world_size: int, rank: int, seed: int, global_batch: int):
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.global_batch = global_batch
        self.steps_per_epoch = len(dataset) // global_batch
        self.start_step = 0  # within the current epoch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=g)[: self.steps_per_epoch * self.global_batch]
        order = order[self.start_step * self.global_batch:]
        return iter(order[self.rank::self.num_replicas].tolist())

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.global_batch // self.num_replicas


def step_batches(dataset, micro_batch_size: int, grad_accum_steps: int, world_size: int, rank: int,
                 seed: int, start_step: int = 0) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Endless iterator of steps, each a list of grad_accum_steps micro-batches for this rank."""
    global_batch = micro_batch_size * grad_accum_steps * world_size
    sampler = GlobalOrderSampler(dataset, world_size, rank, seed, global_batch)
    if sampler.steps_per_epoch == 0:
        raise ConfigError(
            f"data.path gives {len(dataset)} rows of data.seq_len tokens, fewer than one global batch "
            f"(train.micro_batch_size x train.grad_accum_steps x {world_size} ranks = {global_batch}); "
            "lower those or add data")
    loader = DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, drop_last=True)
    epoch, sampler.start_step = divmod(start_step, sampler.steps_per_epoch)
    while True:
        sampler.set_epoch(epoch)  # a new order every epoch, the same on every rank
        it = iter(loader)
        for _ in range(sampler.steps_per_epoch - sampler.start_step):
            yield [next(it) for _ in range(grad_accum_steps)]
        epoch, sampler.start_step = epoch + 1, 0

