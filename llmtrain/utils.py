"""Small helpers every layer may use (a leaf: imports nothing of llmtrain): dtype names, giving freed heap
back to the OS, the one content hash and the one atomic publish (checkpoints, exports, DPO's reference cache,
distillation's teacher logits), telling a full disk (free space, ENOSPC in any form), and printing to a pipe that
may close early."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
from pathlib import Path
from typing import BinaryIO

import torch
import xxhash

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SMALL_FILE = 64 << 20  # hashed whole up to this size; larger ones by sampled blocks
HASH = "xxh3_64"  # content_hash's algorithm: the key its values are stored under


def hash_sampled(h, fh: BinaryIO, start: int, size: int, samples: int = 16) -> None:
    """Feed bytes start..size of an open file to hash `h`: all of them up to SMALL_FILE, else `samples` 1-MiB
    blocks spread over them (a fingerprint that tells two fine-tunes or two data sets apart in milliseconds)."""
    fh.seek(start)
    if size - start <= SMALL_FILE:
        h.update(fh.read())
        return
    for i in range(samples):
        fh.seek(start + (size - start) * i // samples)
        h.update(fh.read(1 << 20))


def release_freed_memory() -> None:
    """FSDP1 materializes and unshards unit by unit; glibc keeps the freed unit-sized blocks in its heap,
    so RSS would stay at the transient peak. Give them back to the OS (a no-op elsewhere than glibc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def content_hash(content: bytes | Path) -> str:
    """The hash of some bytes or of a file's contents (read in 16 MiB blocks) that checkpoint manifests, cache
    keys and stored values record: xxh3_64 (HASH), a non-cryptographic hash at several GB/s: it tells damaged or
    other contents from the ones recorded, not a forgery."""
    h = xxhash.xxh3_64()
    if isinstance(content, Path):
        with content.open("rb") as f:
            while block := f.read(16 << 20):
                h.update(block)
    else:
        h.update(content)
    return h.hexdigest()


def publish(tmp: Path, final: Path, keep: str = "") -> None:
    """Replace `final` (a file or a directory) by the complete `tmp`, a sibling on the same file system: its
    files are fsynced, then it is renamed, so a reader sees the old `final`, the new one or none, never half.
    keep: a glob of final's entries moved into the new one first (an export keeps the step_* exports made during
    training)."""
    for file in [tmp] if tmp.is_file() else (p for p in tmp.rglob("*") if p.is_file()):
        with file.open("rb") as f:
            os.fsync(f.fileno())
    if not tmp.is_dir() or not final.exists():
        os.replace(tmp, final)
        return
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    for sub in final.glob(keep) if keep else ():
        sub.rename(tmp / sub.name)
    final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def no_space(exc: BaseException | None) -> bool:
    """Whether `exc` (or what caused it, or a rank's failure inside a DCP CheckpointException) is a full disk:
    ENOSPC, the safetensors/Rust wording of it ("No space left on device", "StorageFull"), or torch.save's zip
    writer after a short write ("[enforce fail at inline_container.cc] unexpected pos", its only symptom)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        if any(no_space(failure[0]) for failure in getattr(exc, "failures", {}).values()):
            return True
        if any(sign in str(exc) for sign in ("No space left on device", "StorageFull", "unexpected pos")):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def free_bytes(path: str | Path) -> int:
    """Free bytes on the filesystem holding `path` (its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def megabytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def print_piped(text: str) -> None:
    """Write text to stdout; a reader that stops early (`| head`) ends the output quietly, as a Unix filter's
    does, instead of a BrokenPipeError traceback."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to fail at exit's flush


def follow_umask(path: Path) -> None:
    """Give `path` the mode open() gives a new file (0666 less the umask): safetensors' save_file creates its
    files 0600 whatever the umask."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def nesting(path: Path, other: Path) -> str | None:
    """How resolved `path` stands to resolved `other`: "is", "lies inside", "holds", or None when apart."""
    return "is" if path == other else "lies inside" if other in path.parents else \
        "holds" if path in other.parents else None
