"""Data: sources (Hugging Face datasets) -> formats (text / instruction / chat -> ids + labels) ->
packing (rows of seq_len with per-example position_ids) -> the global sample order (sampling.py).

Map-style (default): tokenized once with datasets.map, cached by fingerprint; rank 0 builds the
cache while the others wait, then they read it. Streaming (data.streaming): IterableDataset +
split_dataset_by_node, tokenized and packed on the fly; ranks agree when to wrap to a new epoch."""

from __future__ import annotations

import functools
import json
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from llmtrain.config import ConfigError, DataConfig, SourceConfig, template_file
from llmtrain.data import sources as sources_lib, vision
from llmtrain.data.formats import FORMATS, IGNORE, SAMPLE_INDEX, BadRecord, Format, Rows, prepare_tokenizer
from llmtrain.data.packing import RowBuilder, to_rows
from llmtrain.data.sampling import GlobalOrderSampler, step_batches
from llmtrain.data.sources import resolve_files

__all__ = ["IGNORE", "SAMPLE_INDEX", "FORMATS", "Format", "Rows", "GlobalOrderSampler", "step_batches",
           "resolve_files", "check", "formats_used", "rows_kind", "build", "Built", "StreamSteps", "MapSteps",
           "make_steps", "pairs_batch", "prepare_tokenizer"]

PACK_BATCH = 1000  # examples packed together; the last row of each batch is padded


def sources(section: DataConfig) -> list[SourceConfig]:
    return section.sources or [SourceConfig(section.path, section.format, 1.0)]


def formats_used(section: DataConfig) -> set[str]:
    """The formats (FORMATS' names) a data section reads: data.format, or each of data.sources' formats."""
    return {s.format for s in sources(section)}


def rows_kind(section: DataConfig) -> Rows:
    """The one kind of rows (FORMATS[f].rows) the section's formats make: a run trains on one kind."""
    kinds = {FORMATS[f].rows.name: FORMATS[f].rows for f in sorted(formats_used(section))}
    if len(kinds) > 1:
        made = ", ".join(f"{f}: {FORMATS[f].rows.name}" for f in sorted(formats_used(section)))
        raise ConfigError(f"data.sources mixes formats that make different kinds of rows ({made}); "
                          "one run trains on one kind")
    return next(iter(kinds.values()))


def check(section: DataConfig) -> None:
    """File-level checks, cheap enough for set-up (before any process group)."""
    for i, src in enumerate(sources(section)):
        sources_lib.check(src.path, "data.path" if not section.sources else f"data.sources[{i}].path")
        if src.weight <= 0:
            raise ConfigError(f"data.sources[{i}].weight must be > 0")
    if section.val_path:
        sources_lib.check(section.val_path, "data.val_path")
    chat_template(section)
    kind = rows_kind(section)
    if section.streaming and not kind.packs:
        raise ConfigError(f"data.streaming: data.format {', '.join(sorted(formats_used(section)))} makes "
                          f"{kind.name}, which are not packed and cannot be streamed; set data.streaming=false")





def chat_template(section: DataConfig) -> str | None:
    """data.chat_template's Jinja text: the value itself, or read from the .jinja/.json file it names."""
    value = section.chat_template
    if value is None or not template_file(value):
        return value
    path = Path(value)
    if not path.is_file():
        raise ConfigError(f"data.chat_template: no such file: {value} (a value ending in .jinja or .json names a "
                          "file; give the template's text otherwise)")
    if path.suffix == ".jinja":
        return path.read_text()
    try:
        template = json.loads(path.read_text()).get("chat_template")
    except (ValueError, AttributeError) as e:
        raise ConfigError(f"data.chat_template: {value} is not a JSON object ({e})") from None
    if isinstance(template, list):  # several named templates (tokenizer_config.json): the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        raise ConfigError(f"data.chat_template: {value} has no chat_template text (a tokenizer_config.json-like "
                          "{\"chat_template\": \"...\"})")
    return template


@dataclass
class Stats:
    num_examples: int = 0
    skipped: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    truncated: int = 0
    streaming: bool = False
    first_bad: str = ""  # file:line and reason of the first skipped record
    first_truncated: str = ""  # file:line of the first truncated example
    held_out: int = 0  # examples held out for validation (data.val_fraction)
    template_note: str | None = None  # which chat template, when not the tokenizer's own (prepare_tokenizer)
    untrained: str = ""  # why no row has a trained token (a run refuses to train nothing), "" when one does

    def summary(self) -> str:
        if self.streaming:  # nothing is read ahead; bad records are counted as they stream past
            return "streaming (tokenized and packed on the fly)"
        text = plural(self.num_examples, "example")
        if self.held_out:
            text += f" (and {self.held_out} held out for validation)"
        if self.skipped:
            top = ", ".join(f"{r} ({n})" for r, n in sorted(self.reasons.items(), key=lambda x: -x[1])[:3])
            text += f", {plural(self.skipped, 'bad record')} skipped: {top}; the first at {self.first_bad}"
        if self.truncated:
            text += f", {self.truncated} truncated to data.seq_len"
            if self.first_truncated:
                text += f"; the first at {self.first_truncated}"
        return text


def plural(n: int, noun: str) -> str:
    """`1 example`, `2 examples`."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _encode_batch(batch, section: DataConfig, fmt: Format, tokenizer, decode=None) -> dict:
    """A batch of loaded rows -> the columns of their format's kind of rows, and each bad record's reason and
    place ("" for a good one). decode: for a batch read as a pyarrow Table (image data), its features'
    decode_batch (Image columns undecoded: data/vision.py)."""
    if decode is not None:
        batch = decode(batch.to_pydict())
    out = {**{k: [] for k in fmt.rows.empty}, "error": [], "where": []}
    for row in (dict(zip(batch, values)) for values in zip(*batch.values())):
        record, where, error = sources_lib.record_of(row)
        example = fmt.rows.empty
        if not error:
            try:
                example = fmt.rows.columns(fmt.encode(record, section, tokenizer), fmt, section)
            except BadRecord as e:
                error = str(e)
        for key, value in example.items():
            out[key].append(value)
        out["error"].append(error)
        out["where"].append(where if error else "")
    return out


def _where(index: int, examples, parts: list[sources_lib.Part]) -> str:
    """File and line (or row) of the record at `index`."""
    if where := examples[index]["where"]:
        return where
    for part in parts:
        if index < part.rows:
            return part.where(index)
        index -= part.rows
    return f"record {index + 1}"


def _examples(path: str, fmt: str, key: str, section: DataConfig, tokenizer, stats: Stats, processor=None):
    """processor: a vision-language model's (data/vision.py), which renders chat records with their images
    (found next to their data file) in place of the tokenizer."""
    from datasets import concatenate_datasets

    def encode(ds, name: str, folder: Path):
        # Image data is read as stored and decoded here, its Image columns left undecoded (data/vision.py).
        source = ds if processor is None else ds.with_format("arrow")
        decode = None if processor is None else vision.undecoded(ds.features).decode_batch
        out = source.map(_encode_batch, batched=True, remove_columns=ds.column_names, desc=f"tokenize {name}",
                         # The Format itself, not its name: datasets' cache key hashes functions by name only, so
                         # the format's definition (its columns among it) is what tells a cache of older rows apart.
                         fn_kwargs={"section": section, "tokenizer": processor or tokenizer, "decode": decode,
                                    "fmt": FORMATS[fmt] if processor is None else vision.chat_format(folder)},
                         features=None if processor is None else vision.features(error="string", where="string"))
        return out if processor is None else out.with_format(None)

    encoded, parts = [], []
    for ds, part in sources_lib.load(path, key):
        name, folder = Path(part.name).name, Path(part.name) if Path(part.name).is_dir() else Path(part.name).parent
        try:
            encoded.append(encode(ds, name, folder))
        except UnicodeDecodeError:  # pyarrow keeps JSON strings' bytes unchecked until they are read as text
            encoded.append(encode(sources_lib.read_numbered(part.name), name, folder))
        parts.append(sources_lib.Part(part.name, len(encoded[-1])))
    ds = concatenate_datasets(encoded) if len(encoded) > 1 else encoded[0]
    errors = ds["error"]
    bad = [i for i, e in enumerate(errors) if e]
    if bad:
        first = f"{_where(bad[0], ds, parts)}: {errors[bad[0]]}"
        if section.strict:
            raise ConfigError(f"{first} (data.strict=true; false skips bad records)")
        stats.first_bad = stats.first_bad or first
    for i in bad:
        stats.reasons[errors[i]] = stats.reasons.get(errors[i], 0) + 1
    stats.skipped += len(bad)
    if not stats.first_truncated:  # named like the first skipped record
        first = next((i for i, (t, e) in enumerate(zip(ds["truncated"], errors)) if t and not e), None)
        stats.first_truncated = "" if first is None else _where(first, ds, parts)
    ds = ds.remove_columns("where")
    kept = ds.filter(lambda e: not e, input_columns="error") if bad else ds
    return kept.remove_columns("error")


def _pack_batch(batch: dict, seq_len: int, pad_id: int, packing: bool) -> dict:
    rows, _ = to_rows(zip(batch["input_ids"], batch["labels"], batch["split"]), seq_len, pad_id, packing)
    return rows


def _rows(examples, kind: Rows, section: DataConfig, tokenizer, stats: Stats):
    stats.num_examples += len(examples)
    stats.truncated += sum(examples["truncated"])
    examples = examples.remove_columns("truncated")
    if not kind.packs:  # one example per row: kind.collate pads each micro-batch
        return examples
    return examples.map(_pack_batch, batched=True, batch_size=PACK_BATCH, remove_columns=examples.column_names,
                        desc="pack" if section.packing else "pad",
                        fn_kwargs={"seq_len": section.seq_len, "pad_id": tokenizer.pad_token_id,
                                   "packing": section.packing})


Collate = Callable[[list[dict]], dict[str, torch.Tensor]]


@dataclass
class Built:
    train: object  # datasets.Dataset of rows, or a StreamingRows
    val: object | None
    stats: Stats
    # How a micro-batch's rows become tensors (the rows kind's collate with the pad id): None for rows of
    # equal length (stacked as they are); pairs: padded per micro-batch into chosen and rejected rows.
    collate: Collate | None = None


def build(section: DataConfig, tokenizer, seed: int, is_main: bool = True, rank: int = 0,
          world_size: int = 1, processor=None) -> Built:
    """Train (and validation) rows. Collective when a process group exists: rank 0 tokenizes first
    (filling the datasets cache), the others wait, then read the cache. processor: a vision-language model's,
    which renders the chat records with their images (data/vision.py, its chat template its own)."""
    note = None if processor else prepare_tokenizer(tokenizer, formats_used(section), chat_template(section))
    distributed = dist.is_initialized()
    if distributed and not is_main:
        dist.barrier()
    try:
        built = _build(section, tokenizer, seed, rank, world_size, processor)
    finally:
        if distributed and is_main:
            dist.barrier()
    if built.val is not None and len(built.val) == 0:
        raise ConfigError("the validation data yields no rows")
    built.stats.template_note = note
    return built


def _build(section: DataConfig, tokenizer, seed: int, rank: int, world_size: int, processor) -> Built:
    from datasets import interleave_datasets

    stats = Stats(streaming=section.streaming)
    kind = rows_kind(section) if processor is None else vision.IMAGE_ROWS
    val = None
    if section.streaming:
        train = StreamingRows(section, tokenizer, seed, rank, world_size, processor)
    else:
        parts = [_examples(s.path, s.format, f"data.sources[{i}].path" if section.sources else "data.path",
                           section, tokenizer, stats, processor) for i, s in enumerate(sources(section))]
        if len(parts) > 1:
            weights = [s.weight for s in section.sources]
            parts = [interleave_datasets(parts, probabilities=[w / sum(weights) for w in weights], seed=seed,
                                         stopping_strategy="all_exhausted")]
        examples = parts[0]
        if section.val_fraction and not section.val_path:
            split = examples.train_test_split(test_size=section.val_fraction, seed=seed, shuffle=True)
            examples, val = split["train"], _rows(split["test"], kind, section, tokenizer, Stats())
            stats.held_out = len(split["test"])
        train = _rows(examples, kind, section, tokenizer, stats)
        if len(train) == 0:
            raise ConfigError(f"the training data yields no rows ({stats.summary()})")
        if kind.packs:
            stats.untrained = untrained(train, examples, section.seq_len)
        if kind.index:  # validation rows have none: nothing is looked up by it for them
            train = train.add_column(kind.index, list(range(len(train))))
        train = train.with_format("torch")
    if section.val_path:
        val_examples = _examples(section.val_path, sources(section)[0].format, "data.val_path", section, tokenizer,
                                 Stats(), processor)
        val = _rows(val_examples, kind, section, tokenizer, Stats())
    collate = vision.collate_with(processor) if processor is not None else \
        functools.partial(kind.collate, pad_id=tokenizer.pad_token_id) if kind.collate else None
    return Built(train, val.with_format("torch") if val is not None else None, stats, collate)


def untrained(rows, examples, seq_len: int) -> str:
    """Why packed rows none of whose tokens carries a loss train nothing ("" when a token does): a row's first
    label never does (nothing predicts it), and a truncated example keeps only its first seq_len tokens. Names the
    smallest data.seq_len that trains anything on these examples (scanned only then)."""
    for batch in rows.iter(batch_size=PACK_BATCH):
        if any(label != IGNORE for labels in batch["labels"] for label in labels[1:]):
            return ""
    firsts = [next((i for i, label in enumerate(labels) if i and label != IGNORE), None)
              for labels in examples["labels"]]
    need = [1 if split else first for first, split in zip(firsts, examples["split"]) if first or split]
    if not need:
        return "the training data has no trained token at all (every label is masked): check data.format"
    return (f"data.seq_len={seq_len} leaves no trained token in any row: a row's first token is never predicted, "
            "and an example cut to data.seq_len keeps only its prompt; the smallest data.seq_len that trains "
            f"anything on this data is {min(need) + 1}")


class StreamingRows:
    """Rows produced on the fly from this rank's part of the stream (flat memory). processor: a vision-language
    model's (data/vision.py): each record is a row of its own, its images opened as it streams past and decoded
    again per micro-batch."""

    def __init__(self, section: DataConfig, tokenizer, seed: int, rank: int, world_size: int, processor=None):
        from datasets import interleave_datasets
        from datasets.distributed import split_dataset_by_node

        self.section, self.tokenizer, self.rank, self.processor = section, tokenizer, rank, processor
        self.collate = _collate if processor is None else vision.collate_with(processor)
        streams = []
        for i, src in enumerate(sources(section)):
            ds = sources_lib.load_stream(src.path, f"data.sources[{i}].path" if section.sources else "data.path")
            folder = str(Path(src.path) if Path(src.path).is_dir() else Path(src.path).parent)
            ds = ds if processor is None else vision.undecoded_stream(ds)
            streams.append(ds.map(lambda r, f=src.format, d=folder: {"__format": f, "__folder": d}))
        if len(streams) > 1:
            weights = [s.weight for s in section.sources]
            stream = interleave_datasets(streams, probabilities=[w / sum(weights) for w in weights], seed=seed,
                                         stopping_strategy="all_exhausted")
        else:
            stream = streams[0]
        self.stream = split_dataset_by_node(stream, rank=rank, world_size=world_size).shuffle(
            seed=seed, buffer_size=section.shuffle_buffer)

    def _format(self, record: dict) -> tuple[Format, object]:
        """The record's format and what encodes it (the tokenizer, or the processor with images found beside
        the record's file)."""
        fmt, folder = FORMATS[record.pop("__format")], record.pop("__folder")
        if self.processor is None:
            return fmt, self.tokenizer
        return vision.chat_format(Path(record["__file"]).parent if "__file" in record else folder), self.processor

    def rows(self, epoch: int) -> Iterator[dict[str, list[int]]]:
        self.stream.set_epoch(epoch)  # a new shuffle every epoch
        builder = RowBuilder(self.section.seq_len, self.tokenizer.pad_token_id)
        for record in self.stream:
            fmt, encoder = self._format(record)
            record, where, error = sources_lib.record_of(record)
            try:
                if error:
                    raise BadRecord(error)
                example = fmt.rows.columns(fmt.encode(record, self.section, encoder), fmt, self.section)
            except BadRecord as e:
                if self.section.strict:
                    raise ConfigError(f"{where + ': ' if where else ''}{e} (data.strict=true)") from None
                warnings.warn(f"skipping bad records: {e}")  # once per reason (warnings dedups)
                continue
            if not fmt.rows.packs:  # a row of its own, padded with its micro-batch by self.collate
                yield {k: v for k, v in example.items() if k != "truncated"}
                continue
            builder.add(example["input_ids"], example["labels"], example["split"] and self.section.packing)
            if not self.section.packing:
                builder.flush()
            yield from _drain(builder)
        builder.flush()
        yield from _drain(builder)


def _drain(builder: RowBuilder) -> Iterator[dict[str, list[int]]]:
    rows = builder.rows
    for i in range(len(rows["input_ids"])):
        yield {k: v[i] for k, v in rows.items()}
    for v in rows.values():
        v.clear()


def _collate(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor([r[k] for r in rows]) for k in rows[0]}


def pairs_batch(built: Built, positions: list[int]) -> dict[str, torch.Tensor]:
    """The pairs at these positions of built.train, collated as a training micro-batch."""
    return built.collate([built.train[i] for i in positions])


class MapSteps:
    """Steps over map-style rows; the position is the global sample count."""

    def __init__(self, rows, micro: int, accum: int, world_size: int, rank: int, seed: int, samples_seen: int,
                 collate: Collate | None = None):
        self.global_batch = micro * accum * world_size
        if self.global_batch > len(rows):  # the sampler would put the same rows into one batch many times
            raise ConfigError(f"the training data gives {len(rows)} rows of data.seq_len tokens, fewer than one "
                              f"step's global batch of {self.global_batch} (train.micro_batch_size {micro} x "
                              f"train.grad_accum_steps {accum} x {world_size} ranks); lower those or add data")
        self.samples_seen = samples_seen
        self.it = step_batches(rows, micro, accum, world_size, rank, seed, samples_seen, collate)

    def __next__(self) -> list[dict[str, torch.Tensor]]:
        self.samples_seen += self.global_batch
        return next(self.it)

    def position(self) -> dict:
        return {"samples_seen": self.samples_seen}


class StreamSteps:
    """Steps over a stream. When any rank's part runs out, all ranks move to the next epoch together,
    so uneven shards never leave a rank waiting in a collective. The position (epoch, rows taken by
    each rank in it) resumes exactly at the same world size, approximately at another."""

    def __init__(self, rows: StreamingRows, micro: int, accum: int, device: torch.device, position: dict,
                 world_size: int):
        self.rows, self.micro, self.accum, self.device = rows, micro, accum, device
        self.epoch = position.get("epoch", 0)
        scale = position.get("world_size", world_size) / world_size
        self.taken = int(position.get("rows", 0) * scale)
        self.world_size = world_size
        self.it = self._skip(self.taken)

    def _skip(self, n: int) -> Iterator:
        it = self.rows.rows(self.epoch)
        for _ in range(n):
            next(it, None)
        return it

    def __next__(self) -> list[dict[str, torch.Tensor]]:
        need = self.micro * self.accum
        for _ in range(2):
            got = [r for _, r in zip(range(need), self.it)]
            short = torch.tensor([float(len(got) < need), float(self.taken == 0 and len(got) < need)],
                                 device=self.device)
            dist.all_reduce(short, op=dist.ReduceOp.MAX)
            if not short[0]:
                self.taken += need
                # SAMPLE_INDEX as the map-style order numbers samples (a stream has no global order)
                return [{**self.rows.collate(got[i * self.micro:(i + 1) * self.micro]),
                         SAMPLE_INDEX: self.rows.rank + self.world_size * (i * self.micro + torch.arange(self.micro))}
                        for i in range(self.accum)]
            if short[1]:
                raise ConfigError(f"a rank's share of the streamed data holds fewer than {need} rows of "
                                  "data.seq_len tokens; use fewer ranks, a smaller batch or more data")
            self.epoch, self.taken = self.epoch + 1, 0
            self.it = self.rows.rows(self.epoch)
        raise AssertionError("unreachable")

    def position(self) -> dict:
        return {"epoch": self.epoch, "rows": self.taken, "world_size": self.world_size}


def make_steps(built: Built, micro: int, accum: int, world_size: int, rank: int, seed: int,
               device: torch.device, position: dict):
    if isinstance(built.train, StreamingRows):
        return StreamSteps(built.train, micro, accum, device, position, world_size)
    return MapSteps(built.train, micro, accum, world_size, rank, seed, position.get("samples_seen", 0), built.collate)


def eval_batches(val, micro: int, world_size: int, rank: int, max_batches: int,
                 collate: Collate | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's validation micro-batches (rows made into tensors by `collate`, Built.collate). Every
    rank yields the same number of batches (a rank with fewer rows gets an all-ignored batch), since FSDP
    forwards are collectives."""
    n_batches = math.ceil(len(val) / (micro * world_size))
    if max_batches:
        n_batches = min(n_batches, max_batches)
    indices = list(range(rank, len(val), world_size))
    def batch(rows: list[int]) -> dict[str, torch.Tensor]:
        return val[rows] if collate is None else collate([val[i] for i in rows])

    for b in range(n_batches):
        chunk = indices[b * micro:(b + 1) * micro]
        if chunk:
            yield batch(chunk)
        else:
            dummy = batch([0])
            dummy["labels"] = torch.full_like(dummy["labels"], IGNORE)
            yield dummy
