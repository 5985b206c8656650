"""A full disk, on a real small filesystem: a 40 MiB tmpfs mounted by the test (root only). The
first line a user sees names the cause, the directory, the size and what is intact; the tracebacks go to
output_dir/errors-rank<R>.log; a full disk at the final export never loses the weights silently: the export
waits for space (and is written once there is some), or every rank ends with the same clear error."""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest
from safetensors.torch import load_file

from helpers.procs import TWO_RANKS, run_recipe, start_recipe
from llmtrain.checkpoint import space_warning, verify
from llmtrain.utils import no_space

# 1.3M parameters: a checkpoint (weights + AdamW's two states) is 15 MiB, the fp32 export 5 MiB; 40 MiB holds two
# checkpoints, not three.
BIGGER = ("model.config.hidden_size=256", "model.config.intermediate_size=512")


@pytest.fixture
def small_fs():
    """A 40 MiB tmpfs, unmounted afterwards."""
    mount = Path(tempfile.mkdtemp(prefix="llmtrain-disk-"))
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mount)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        mount.rmdir()
        pytest.skip(f"mounting a tmpfs is not permitted here (needs root): {res.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
        mount.rmdir()


def first_error(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if line.startswith("error"))


def fill(mount: Path, leave_mib: int) -> Path:
    """A file that leaves `leave_mib` MiB free on the filesystem."""
    filler = mount / "filler"
    free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
    subprocess.run(["fallocate", "-l", str(free - (leave_mib << 20)), str(filler)], check=True)
    return filler


def test_no_space_is_recognized_in_every_form():
    assert no_space(OSError(errno.ENOSPC, "No space left on device"))
    assert no_space(RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, ... })"))
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert no_space(wrapped)
    assert no_space(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 2048 vs 1990"))
    assert not no_space(OSError(errno.EACCES, "Permission denied"))


def test_space_warning_names_the_numbers(tmp_path):
    assert space_warning(str(tmp_path), 1 << 20, 2, 1 << 20, 2) is None
    line = space_warning(str(tmp_path), 1 << 50, 3, 1 << 40, 2)
    assert line.startswith(f"output_dir {tmp_path} has ")
    assert "3 checkpoints of about 1073741824.0 MiB each" in line and "536870912.0 MiB per rank" in line
    assert "the export about 1048576.0 MiB" in line
    assert "the export" in space_warning(str(tmp_path), 1 << 20, 0, 1 << 50, 1)
    assert "checkpoint" not in space_warning(str(tmp_path), 1 << 20, 0, 1 << 50, 1)


@pytest.mark.slow
def test_checkpoints_on_a_full_disk(small_fs):
    out = small_fs / "out"
    res = run_recipe(out, *TWO_RANKS, *BIGGER, "train.max_steps=12", "checkpoint.every_steps=3",
                     "checkpoint.keep_last=0", nproc=2, check=False)
    assert res.returncode == 1
    line = first_error(res.stderr)
    assert line.startswith(f"error: no space left on device in {out / 'checkpoints'}: saving checkpoint step_9 "
                           "(about 15.0 MiB) failed with ")
    assert "the partial save was removed; earlier checkpoints are intact (newest: step_6" in line
    assert f"traceback in {out / 'errors-rank0.log'}" in line
    # The ranks' DCP tracebacks are in the logs, not on the console (torchrun's own report of the exit stays).
    assert "CheckpointException" not in res.stderr and "llmtrain/checkpoint.py" not in res.stderr
    # One console line for the error every rank raised (torchrun's report repeats it as each rank's cause).
    assert len(re.findall(r"(?m)^error:", res.stderr)) == 1, "one line for the error every rank raised"
    for rank in (0, 1):
        assert "Traceback" in (out / f"errors-rank{rank}.log").read_text()
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step_3", "step_6"]
    assert verify(out / "checkpoints" / "step_3") == [] and verify(out / "checkpoints" / "step_6") == []

    # Space freed: the same run resumes from step_6 and finishes (keep_last=1 keeps it within the disk).
    shutil.rmtree(out / "checkpoints" / "step_3")
    res = run_recipe(out, *TWO_RANKS, *BIGGER, "train.max_steps=12", "checkpoint.every_steps=3",
                     "checkpoint.keep_last=1", nproc=2)
    assert "resumed at step 6" in res.stdout
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_12"]
    assert (out / "hf" / "model.safetensors").is_file()


@pytest.mark.slow
def test_final_export_on_a_full_disk_ends_with_the_same_clear_error_on_every_rank(small_fs):
    out = small_fs / "out"
    out.mkdir()
    fill(small_fs, leave_mib=3)
    res = run_recipe(out, *TWO_RANKS, *BIGGER, "checkpoint.export_wait_minutes=0.05", nproc=2, check=False,
                     torchrun=True)
    assert res.returncode == 1
    assert f"warning: output_dir {out} has 3.0 MiB free, but the run writes the export about 5.0 MiB" in res.stdout
    line = first_error(res.stderr)
    # Where the weights are is said once: here no checkpoint holds them.
    assert line == (f"error: no space left on device in {out}: the export hf (about 5.0 MiB) could not be written "
                    "(3.0 MiB free after waiting 0.05 minutes, checkpoint.export_wait_minutes); the partial hf.tmp "
                    "was removed; no checkpoint holds the trained weights: they are lost "
                    f"(traceback in {out / 'errors-rank0.log'})")
    assert "Connection closed by peer" not in res.stderr + res.stdout and "SafetensorError" not in res.stderr
    assert res.stderr.count("exitcode  : 1") == 2, "both ranks exit with the same code"
    assert not (out / "hf.tmp").exists() and not (out / "hf").exists()


@pytest.mark.slow
def test_final_export_waits_for_space_and_keeps_the_weights(small_fs):
    out = small_fs / "out"
    out.mkdir()
    filler = fill(small_fs, leave_mib=3)
    proc = start_recipe(out, *TWO_RANKS, *BIGGER, "checkpoint.export_wait_minutes=0.5", nproc=2)
    seen: list[str] = []

    def watch():  # the user reads the warning and frees space
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("warning: no space left on device"):
                filler.unlink()

    reader = threading.Thread(target=watch)
    reader.start()
    try:
        rc = proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    reader.join()
    assert rc == 0, "".join(seen)[-3000:]
    warning = next(line for line in seen if line.startswith("warning: no space left on device"))
    assert f"in {out}: the export hf needs about" in warning
    assert "The trained weights are kept in memory: free space there; retrying every 3 s for up to 0.5 minutes" \
        in warning
    assert len(load_file(out / "hf" / "model.safetensors")) == 20  # embed + 2 x 9 per layer + norm (tied head)
    assert not (out / "hf.tmp").exists()
