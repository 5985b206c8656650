"""`checkpoint` (python bench/run.py --only checkpoint): DCP save / load through CheckpointManager and the HF export of
an ~106M-parameter model on 2 ranks (bench/benchmarks/checkpoint/probe.py) vs `dd` of the same size in the same
directory."""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

from benchmarks.base import Ctx, MEM_SHAPE, MEM_SHAPE_QUICK, TIMEOUT, ratio, table
from common import BenchError, median, torchrun


CKPT_SHAPE = {**MEM_SHAPE, "tie_word_embeddings": False}
CKPT_SHAPE_QUICK = {**MEM_SHAPE_QUICK, "tie_word_embeddings": False}


def dd(path: Path, mib: int, streams: int = 1) -> tuple[float, float]:
    """(write seconds with fsync, read seconds) of `mib` MiB in `streams` parallel dd's in path's directory."""
    each = max(1, mib // streams)
    files = [path.with_name(f"{path.name}.{i}") for i in range(streams)]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["dd", "if=/dev/zero", f"of={f}", "bs=1M", f"count={each}", "conv=fsync"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for f in files]
    if any(p.wait() for p in procs):
        raise BenchError("dd write failed")
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["dd", f"if={f}", "of=/dev/null", "bs=1M"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for f in files]
    if any(p.wait() for p in procs):
        raise BenchError("dd read failed")
    read_s = time.perf_counter() - t0
    for f in files:
        f.unlink()
    return write_s, read_s


def bench(ctx: Ctx) -> dict:
    work = ctx.dir("checkpoint")
    shape = CKPT_SHAPE_QUICK if ctx.quick else CKPT_SHAPE
    res = work / "ckpt.json"
    torchrun([Path(__file__).parent / "probe.py", "--dir", work, "--shape", json.dumps(shape), "--out", res],
             timeout=TIMEOUT, log=work / "ckpt.log")
    c = json.loads(res.read_text())
    size = c["checkpoint_bytes"]
    mib = math.ceil(size / 2**20)
    target = work / "run" / "checkpoints" / "ddfile"
    one = [dd(target, mib, 1) for _ in range(2)]
    two = dd(target, mib, 2)
    dd_w, dd_r = median([w for w, _ in one]), median([r for _, r in one])
    mb = size / 1e6
    exp_mb = c["export_bytes"] / 1e6
    rows = [["DCP save (CheckpointManager.save, 2 ranks, fsync)", f"{c['save_s']:.2f}", f"{mb / c['save_s']:,.0f}",
             f"{(mb / c['save_s']) / (mb / dd_w):.2f}"],
            ["`dd` write, same size, conv=fsync (1 stream)", f"{dd_w:.2f}", f"{mb / dd_w:,.0f}", "1.00"],
            ["`dd` write, 2 parallel streams of half", f"{two[0]:.2f}", f"{mb / two[0]:,.0f}",
             f"{dd_w / two[0]:.2f}"],
            ["DCP load (resume, page cache warm)", f"{c['load_s']:.2f}", f"{mb / c['load_s']:,.0f}",
             f"{(mb / c['load_s']) / (mb / dd_r):.2f} (vs dd read)"],
            ["`dd` read, same file size (page cache warm)", f"{dd_r:.2f}", f"{mb / dd_r:,.0f}", ""],
            ["HF export (export_hf: gather to rank 0, safetensors fp32)", f"{c['export_s']:.2f}",
             f"{exp_mb / c['export_s']:,.0f}", f"{(exp_mb / c['export_s']) / (mb / dd_w):.2f}"]]
    text = table(["operation", "seconds", "MB/s", "MB/s vs dd write"], rows)
    text += (f"\n\n{c['n_params'] / 1e6:.1f}M-parameter Llama (untied embeddings), {c['strategy']}, 2 ranks; "
             f"checkpoint {size / 1e6:,.0f} MB (fp32 weights + AdamW moments), export {exp_mb:,.0f} MB. "
             "Save includes the rename publish and the small JSON/config files; load includes "
             "set_state_dict. `dd` runs right after, in the checkpoints directory (median of 2).")
    return {"title": "Checkpoint save / load / export vs dd", "table": text,
            "ratios": [ratio("checkpoint: DCP save MB/s / dd write MB/s", (mb / c["save_s"]) / (mb / dd_w)),
                       ratio("checkpoint: DCP load MB/s / dd read MB/s", (mb / c["load_s"]) / (mb / dd_r)),
                       ratio("checkpoint: HF export MB/s / dd write MB/s", (exp_mb / c["export_s"]) / (mb / dd_w))],
            "raw": {**c, "dd_write_s": [w for w, _ in one], "dd_read_s": [r for _, r in one],
                    "dd_write_2streams_s": two[0], "dd_mib": mib}}
