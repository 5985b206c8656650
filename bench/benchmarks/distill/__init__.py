"""`distill` (python bench/run.py --only distill): recipes/distill.py's peak memory and step time at a real
vocabulary: 131,072 ids (the bundled tokenizer grown locally, nothing downloaded), 2 ranks gloo, DDP, one
micro-batch of 2048 packed tokens per rank (llama-128k's data), a random Llama student (hidden 64, 2 layers) and a
larger teacher (hidden 128, 4 layers), both untied, so that the [tokens x vocab] logits (1 GiB per model and rank
in fp32) dominate, as they do in real KD. Side by side in one run (bench/benchmarks/distill/worker.py runs both sides):

  full-logits KD  what a user of TRL's GKDTrainer runs: both models' whole logits, TRL's generalized_jsd_loss
                  (beta 0: forward KL), backward, step
  recipe          the recipe with a live teacher, distill.loss forward_kl (the default) and jsd (beta 0.5)
  offline         python -m llmtrain.tools.distill_precompute (top 64), then the recipe on distill.teacher_logits

Targets (the issue): recipe / full-logits peak memory per rank <= 0.5x, step time <= 1.0x; offline against online
reported. 4 steps a run, the first left out: about 10 minutes of CPU on 2 cores in all."""

from __future__ import annotations

import json
import re
import resource
import shutil
import sys
from pathlib import Path

from benchmarks.base import SHAPE_128K, Ctx, TIMEOUT, ratio, table, write_config
from benchmarks.memory import MEMORY_PROBE
from common import REPO, fmt_bytes, median, run, torchrun, train_records

WORKER = Path(__file__).parent / "worker.py"
VOCAB, QUICK_VOCAB = 131072, 8192
LLAMA = {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
         "tie_word_embeddings": False}
STUDENT = {**LLAMA, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2}
TEACHER = {**LLAMA, "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4}
TOP_K = 64


def grown_tokenizer(out, size: int):
    """assets/tokenizer (byte-level BPE, 512 ids) with entries <x000512> ... appended to its vocabulary up to
    `size` ids. No merge produces them, so the data's ids stay below 512; what the benchmark needs is the
    vocabulary's size: both models' output layers and every softmax span all `size` ids."""
    src = REPO / "assets" / "tokenizer"
    shutil.copytree(src, out, dirs_exist_ok=True)
    spec = json.loads((src / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab.update({f"<x{i:06d}>": i for i in range(len(vocab), size)})
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


def children_cpu() -> float:
    """CPU seconds of every finished, waited-for descendant (torchrun waits for its ranks)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def steps_cpu(log, warmup: int) -> list[dict]:
    """CPU and system seconds of one rank's steps after `warmup`, from its cpu_rank<R>.jsonl (totals after each
    step)."""
    totals = [json.loads(line) for line in log.read_text().splitlines()]
    return [{k: b[k] - a[k] for k in ("cpu_s", "sys_s")} for a, b in zip(totals[warmup - 1:], totals[warmup:])]


def cpu_figures(ranks: list[list[dict]]) -> dict:
    """Per-rank step lists -> the slower rank's median CPU and system seconds per step, and the range over all."""
    slow = max(ranks, key=lambda steps: median([s["cpu_s"] for s in steps]))
    every = [s["cpu_s"] for steps in ranks for s in steps]
    return {"cpu": median([s["cpu_s"] for s in slow]), "sys": median([s["sys_s"] for s in slow]),
            "cpu_range": (min(every), max(every)), "cpu_steps": ranks}


def bench(ctx: Ctx) -> dict:
    vocab = QUICK_VOCAB if ctx.quick else VOCAB
    steps, warmup = (2, 1) if ctx.quick else (4, 1)
    seq = 256 if ctx.quick else 2048
    work = ctx.dir("distill")
    tokenizer = grown_tokenizer(work / "tokenizer", vocab)
    dirs, shapes = {}, {}
    for name, shape in (("student", STUDENT), ("teacher", TEACHER)):
        dirs[name] = work / name
        if ctx.quick:
            shape = {**shape, "hidden_size": shape["hidden_size"] // 2, "intermediate_size": 96}
        shapes[name] = shape
        run([sys.executable, MEMORY_PROBE, "--export", dirs[name], "--shape",
             json.dumps({**shape, "vocab_size": vocab})], TIMEOUT)
    shutil.copytree(tokenizer, dirs["teacher"], dirs_exist_ok=True)  # the teacher directory carries its tokenizer
    cfg = write_config(work / "distill.yaml", SHAPE_128K, {
        "model": {"path": str(dirs["student"]), "config": None}, "tokenizer": {"path": str(tokenizer)},
        "data": {"seq_len": seq}, "parallel": {"strategy": "ddp"},
        "train": {"max_steps": steps, "warmup_steps": 0}, "distill": {"teacher_path": str(dirs["teacher"])},
        "log": {"every_steps": 1, "progress": False}, "checkpoint": {"every_steps": 0, "resume": "never"},
        "distributed": {"preflight": False}})

    def recipe(name: str, *overrides: str) -> dict:
        out, cpu_log = work / name, work / f"{name}-cpu"
        shutil.rmtree(out, ignore_errors=True)
        cpu_log.mkdir(exist_ok=True)
        c0 = children_cpu()
        torchrun([WORKER, "recipe", "--cpu-log", cpu_log, "--", "--config", cfg, f"output_dir={out}", *overrides],
                 timeout=TIMEOUT, log=work / f"{name}.log")
        records = train_records(out)
        logs = sorted(cpu_log.glob("cpu_rank*.jsonl"))
        return {"peak": [max(json.loads(line)["peak_rss"] for line in log.read_text().splitlines()) for log in logs],
                "wall": median([r["step_time_s"] for r in records if r["step"] > warmup]),
                **cpu_figures([steps_cpu(log, warmup) for log in logs]), "run_cpu": children_cpu() - c0,
                "mem_gb": max(r["mem_gb"] for r in records), "kd_loss": records[-1]["kd_loss"],
                "trained_tokens": median([r["trained_tokens"] for r in records])}

    def full(beta: float) -> dict:
        res = work / f"full-{beta:g}.json"
        c0 = children_cpu()
        torchrun([WORKER, "full", "--config", cfg, "--student", dirs["student"], "--teacher", dirs["teacher"],
                  "--beta", beta, "--steps", steps, "--out", res], timeout=TIMEOUT, log=work / f"full-{beta:g}.log")
        ranks = json.loads(res.read_text())["ranks"]
        return {"peak": [r["peak_rss"] for r in ranks],
                "wall": max(median([s["wall_s"] for s in r["steps"][warmup:]]) for r in ranks),
                **cpu_figures([r["steps"][warmup:] for r in ranks]), "run_cpu": children_cpu() - c0,
                "setup": [r["setup_peak_rss"] for r in ranks]}

    runs = {"recipe, forward_kl": recipe("forward_kl"), "full-logits KD, forward KL": full(0.0),
            "recipe, jsd": recipe("jsd", "distill.loss=jsd")}
    store = work / "teacher-top64"
    shutil.rmtree(store, ignore_errors=True)
    c0 = children_cpu()
    out, wall = torchrun(["-m", "llmtrain.tools.distill_precompute", "--config", cfg, "--out", store,
                          f"distill.top_k={TOP_K}"], timeout=TIMEOUT, log=work / "precompute.log")
    inside = float(re.search(r"in ([\d.]+) s ->", out).group(1))
    precompute = {"wall": wall, "inside": inside, "run_cpu": children_cpu() - c0,
                  "bytes": sum(f.stat().st_size for f in store.iterdir())}
    runs[f"recipe, offline top-{TOP_K}"] = recipe("offline", f"distill.top_k={TOP_K}",
                                                   f"distill.teacher_logits={store}")

    ref, online, offline = runs["full-logits KD, forward KL"], runs["recipe, forward_kl"], \
        runs[f"recipe, offline top-{TOP_K}"]
    rows = []
    for name, r in runs.items():
        rows.append([name, " / ".join(f"{p / 2**20:,.0f}" for p in r["peak"]),
                     f"{max(r['peak']) / max(ref['peak']):.2f}", f"{r['wall']:.2f}",
                     f"{r['cpu']:.2f} ({r['sys']:.2f}; {r['cpu_range'][0]:.2f}-{r['cpu_range'][1]:.2f})",
                     f"{r['cpu'] / ref['cpu']:.2f}", f"{r['run_cpu']:.0f}"])
    rows.insert(3, [f"precompute top-{TOP_K} (distill_precompute, {steps} steps' samples)", "", "",
                    f"{wall:.1f} (whole command; {inside:.1f} inside)", "", "", f"{precompute['run_cpu']:.0f}"])
    tokens = online["trained_tokens"] / 2  # per rank
    logits = seq * vocab * 4
    chunk = (256 << 20) // (4 * vocab)
    text = table(["run", "peak RSS MiB, rank 0 / rank 1", "peak vs full-logits", "step wall s",
                  "step CPU s / rank (system; range)", "step CPU vs full-logits",
                  "whole run CPU s (both ranks, start-up incl.)"], rows)
    text += (
        f"\n\nVocabulary {vocab:,} ids (assets/tokenizer grown locally; the data's ids are its first 512), "
        f"micro-batch 1 x {seq} packed tokens of {SHAPE_128K.relative_to(REPO)}'s data per rank "
        f"(~{tokens:.0f} trained), 2 ranks gloo, DDP on every side (the teacher whole on each rank), fp32. Student: "
        f"random Llama, hidden {shapes['student']['hidden_size']}, {shapes['student']['num_hidden_layers']} layers; "
        f"teacher: hidden {shapes['teacher']['hidden_size']}, {shapes['teacher']['num_hidden_layers']} layers; both "
        "untied (one model directory each, which every side loads). "
        f"One [tokens x vocab] fp32 logits tensor: {fmt_bytes(logits)} per model and rank. Full-logits KD: "
        "bench/benchmarks/distill/worker.py full, TRL's GKDTrainer.generalized_jsd_loss re-implemented op for op on "
        "both "
        "models' whole logits (its non-Liger compute_loss), its ranks taking turns through the logits (two ranks "
        "at ~11 GiB each would not fit this machine), so its step is one rank's turn + all-reduce + AdamW. The "
        f"recipe: distill.loss forward_kl (default) or jsd, kd_weight 1, top_k 0 (all ids), chunks of {chunk} "
        f"tokens (train.loss_chunk_tokens' default: 256 MiB of fp32 logits); offline: top-{TOP_K} stored "
        f"({fmt_bytes(precompute['bytes'])}). {steps} steps a run, the first {warmup} left out: step wall s is "
        "the recipe's step_time_s (rank 0) and the full side's slower rank; step CPU s is process CPU time per "
        "step of the slower rank (median; in brackets its system part, page faults mostly, and the range over all "
        "steps and ranks); the ratios use it, since the machine may be shared. Peak RSS: each rank's "
        "getrusage ru_maxrss during training (start-up included).")
    ratios = [
        ratio("distill: recipe (forward_kl) / full-logits KD peak memory per rank",
              max(online["peak"]) / max(ref["peak"]), 0.5, "<="),
        ratio("distill: recipe (forward_kl) / full-logits KD step time (CPU per rank)", online["cpu"] / ref["cpu"],
              1.0, "<="),
        ratio("distill: recipe (jsd) / full-logits KD (forward KL) peak memory per rank",
              max(runs["recipe, jsd"]["peak"]) / max(ref["peak"]), None, "<=",
              "TRL's jsd would hold more than its forward KL: a bound"),
        ratio(f"distill: offline top-{TOP_K} / online peak memory per rank",
              max(offline["peak"]) / max(online["peak"])),
        ratio(f"distill: offline top-{TOP_K} / online step time (CPU per rank)", offline["cpu"] / online["cpu"])]
    return {"title": f"Distillation at a {vocab:,}-id vocabulary: recipe vs full-logits KD, offline vs online teacher",
            "table": text, "ratios": ratios,
            "raw": {"runs": runs, "precompute": precompute, "vocab": vocab, "seq": seq, "steps": steps,
                    "warmup": warmup, **shapes, "logits_bytes": logits,
                    "chunk_tokens": chunk}}
