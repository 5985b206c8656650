"""Where records come from, and every way that can go wrong named by file (and line).

A data path is one of: local files (jsonl/json/parquet/csv/txt: a file, a glob or a directory), a directory
written by `datasets`' save_to_disk (read with load_from_disk), or a Hugging Face Hub dataset id `org/name`
(load_dataset; needs the Hub). JSON Lines go through pyarrow's fast reader; when it fails on a file (a
malformed line, bytes that are not UTF-8) the file is read again line by line, so a bad line becomes a bad
record of its own, named by its 1-based line number, that data.strict decides about like any other."""

from __future__ import annotations

import glob
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from llmtrain.config import ConfigError

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Columns of a file read line by line: the raw line, its 1-based number, why it is not a record ("" if it is).
LINE, JSON, ERROR = "__line", "__json", "__error"
SURROGATE = re.compile(r"[\ud800-\udfff]")


@dataclass
class Part:
    """One loaded piece of a data path: a file, a saved dataset or a Hub dataset; `rows` records."""
    name: str
    rows: int

    def where(self, index: int) -> str:
        """The record at `index` (0-based, within this part) as a user finds it in the file."""
        suffix = Path(self.name).suffix
        if suffix == ".txt":
            return f"{self.name}, line {index + 1}"
        if suffix in (".jsonl", ".json") and not _starts_with(self.name, b"["):
            return f"{self.name}, line {_nth_record_line(self.name, index)}"  # pyarrow skips blank lines
        return f"{self.name}, {'row' if suffix in ('.csv', '.parquet') else 'record'} {index + 1}"


def is_saved_dataset(path: Path) -> bool:
    """A directory written by Dataset.save_to_disk or DatasetDict.save_to_disk."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file()
                              or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()))


def is_hub_id(path: str) -> bool:
    return bool(HUB_ID.match(path)) and not Path(path).exists() and not glob.has_magic(path) \
        and Path(path).suffix not in BUILDERS


def resolve_files(path: str, key: str = "data.path") -> list[str]:
    """A file, a glob or a directory -> sorted data files of one known type."""
    p = Path(path)
    if p.is_dir():
        files = sorted(str(f) for f in p.rglob("*") if f.is_file() and f.suffix in BUILDERS)
    else:
        files = sorted(glob.glob(path, recursive=True))
    if not files:
        raise ConfigError(f"{key}: nothing matches {path!r} (a file, glob or directory of "
                          f"{'/'.join(s[1:] for s in BUILDERS)} files, a save_to_disk directory or a Hub id org/name)")
    suffixes = {Path(f).suffix for f in files}
    if unknown := suffixes - set(BUILDERS):
        raise ConfigError(f"{key}: unsupported file type {sorted(unknown)}; use one of {sorted(BUILDERS)}")
    if len(suffixes) > 1:
        raise ConfigError(f"{key}: mixes file types {sorted(suffixes)}; point it at one type")
    return files


def check(path: str, key: str) -> None:
    """Cheap checks at set-up, before any process group: the path exists, no file is empty, the Hub is
    reachable for a Hub id."""
    if is_saved_dataset(Path(path)):
        return
    if is_hub_id(path):
        _check_hub(path, key)
        return
    for f in resolve_files(path, key):
        if not _has_content(f):
            raise ConfigError(f"{key}: {f} is empty{'' if os.path.getsize(f) == 0 else ' (only blank lines)'}; "
                              "remove it or point the path at files with records")


def _has_content(path: str) -> bool:
    """Anything but whitespace in the file (reads only until the first such byte)."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return True
    return False


def _starts_with(path: str, prefix: bytes) -> bool:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return chunk.lstrip().startswith(prefix)
    return False


def _nth_record_line(path: str, index: int) -> int:
    """1-based line of the index-th non-blank line (only called to name a bad record)."""
    seen = -1
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            seen += bool(line.strip())
            if seen == index:
                return number
    return number


def hub_offline() -> bool:
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in ("HF_HUB_OFFLINE",
                                                                                      "HF_DATASETS_OFFLINE"))


def _check_hub(path: str, key: str) -> None:
    local = (f"pass local files instead: {key}=FILE.jsonl (or a directory or glob of files, or a directory "
             "written by datasets' save_to_disk); download it first where the Hub is reachable, e.g. "
             f"huggingface_hub.snapshot_download({path!r}, repo_type='dataset', local_dir=DIR)")
    if hub_offline():
        raise ConfigError(f"{key}: {path!r} is not a local file or directory, and as a Hugging Face Hub dataset id "
                          f"it cannot be fetched: the Hub is offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); {local}")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().dataset_info(path, timeout=10)
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise ConfigError(f"{key}: {path!r} is not a local path, and no Hub dataset of that name is readable "
                          f"({type(e).__name__}; a private or gated one needs `hf auth login`)") from None
    except Exception as e:  # noqa: BLE001 - connection refused, DNS, timeout, proxy: all mean "unreachable"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"{key}: {path!r} is not a local file or directory, and as a Hugging Face Hub dataset id "
                          f"it cannot be fetched: the Hub is unreachable ({first}); {local}") from None


def load(path: str, key: str) -> list[tuple[object, Part]]:
    """Map-style: (datasets.Dataset, Part) per file (so a bad record is named by file and line), or one for a
    saved or Hub dataset."""
    from datasets import load_dataset

    if is_saved_dataset(Path(path)):
        ds = _load_saved(path, key)
        return [(ds, Part(path, len(ds)))]
    if is_hub_id(path):
        ds = _load_hub(path, key, streaming=False)
        return [(ds, Part(path, len(ds)))]
    files = resolve_files(path, key)
    builder = BUILDERS[Path(files[0]).suffix]
    loaded = []
    # datasets logs its own error for a file pyarrow cannot parse; here that file is read line by line instead.
    quiet = logging.getLogger("datasets.packaged_modules.json.json")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        for f in files:
            try:
                ds = load_dataset(builder, data_files=f, split="train")
            except Exception as e:  # noqa: BLE001 - pyarrow, decoding and generation errors: named below
                cause = e.__cause__ or e
                if builder != "json" or _starts_with(f, b"["):
                    raise ConfigError(f"{f}: cannot be read as {builder} ({type(cause).__name__}: "
                                      f"{(str(cause).strip().splitlines() or [''])[0][:300]}); check the file's "
                                      "format and encoding (UTF-8)") from None
                ds = read_numbered(f)
            loaded.append((ds, Part(f, len(ds))))
    finally:
        quiet.setLevel(level)
    return loaded


def load_stream(path: str, key: str):
    """Streaming: one datasets.IterableDataset. JSON Lines are read as numbered lines, so a bad one is
    named and skipped (or stops the run) instead of a pyarrow traceback."""
    from datasets import IterableDataset, load_dataset

    if is_saved_dataset(Path(path)):
        return _load_saved(path, key).to_iterable_dataset()
    if is_hub_id(path):
        return _load_hub(path, key, streaming=True)
    files = resolve_files(path, key)
    builder = BUILDERS[Path(files[0]).suffix]
    if builder == "json":
        return IterableDataset.from_generator(read_lines, gen_kwargs={"files": files})
    return load_dataset(builder, data_files=files, split="train", streaming=True)


def _load_saved(path: str, key: str):
    from datasets import DatasetDict, load_from_disk

    ds = load_from_disk(path)
    if isinstance(ds, DatasetDict):
        if "train" not in ds and len(ds) != 1:
            raise ConfigError(f"{key}: {path} is a saved DatasetDict without a 'train' split (it has "
                              f"{', '.join(ds)}); point {key} at {path}/<split>")
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    return ds


def _load_hub(path: str, key: str, streaming: bool):
    from datasets import load_dataset

    try:
        return load_dataset(path, split="train", streaming=streaming)
    except Exception as e:  # noqa: BLE001 - named below; load_dataset raises many kinds
        raise ConfigError(f"{key}: cannot load Hub dataset {path!r} (split 'train'): {type(e).__name__}: "
                          f"{(str(e).strip().splitlines() or [''])[0][:300]}") from None


def read_numbered(path: str):
    """A JSON Lines file as numbered lines (read_lines), cached like any dataset."""
    from datasets import Dataset

    st = os.stat(path)  # in the cache key: a changed file is read again
    return Dataset.from_generator(read_lines, gen_kwargs={"files": [path], "stamp": (st.st_size, st.st_mtime_ns)})


def read_lines(files: list[str], stamp: tuple = ()):
    """JSON Lines, one row per non-blank line: the line's text and number, or why it is not a record."""
    for name in files:
        with open(name, "rb") as f:
            for number, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                text, error = "", ""
                try:
                    text = raw.decode("utf-8")
                    record = json.loads(text)
                    if not isinstance(record, dict):
                        error = "not a JSON object"
                    elif bad := lone_surrogate(record):
                        error = bad
                except UnicodeDecodeError as e:
                    error = f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                except json.JSONDecodeError as e:
                    error = f"malformed JSON ({e.msg} at column {e.colno})"
                yield {JSON: text if not error else "", LINE: number, ERROR: error, "__file": name}


def lone_surrogate(value, name: str = "") -> str:
    """Why a decoded JSON record is not text ("" if it is): a lone surrogate escape such as "\\ud800" decodes to
    a str that no tokenizer (nor UTF-8) takes. pyarrow refuses such a line, so only line-read records get here."""
    if isinstance(value, str):
        if m := SURROGATE.search(value):
            return f"field {name!r} holds a lone surrogate escape (\\u{ord(m.group()):04x}): not valid Unicode text"
        return ""
    if isinstance(value, dict):
        items = ((f"{name}.{key}" if name else key, item) for key, item in value.items())
    else:
        items = ((f"{name}[{i}]", item) for i, item in enumerate(value if isinstance(value, list) else ()))
    return next((bad for where, item in items if (bad := lone_surrogate(item, where))), "")


def record_of(row: dict) -> tuple[dict | None, str, str]:
    """(record, where, error) of a loaded row: a line-read row is decoded here; others are records already."""
    if JSON not in row:
        return row, "", ""
    where = f"{row['__file']}, line {row[LINE]}"
    return (json.loads(row[JSON]) if not row[ERROR] else None), where, row[ERROR]
