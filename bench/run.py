#!/usr/bin/env python
"""llmtrain benchmarks: figures measured side by side in one run and reported as ratios (absolute
CPU times on a shared machine are not stable; ratios of interleaved runs are).

    python bench/run.py [--quick] [--only NAME ...] [--results-dir bench/results]

Prints one markdown table per benchmark, then a summary of the ratios against their targets, and
writes <results-dir>/<YYYY-MM-DD>.json (<date>-quick.json with --quick) and a PNG of the ratios next
to it. A later run on the same day with --only replaces only the benchmarks it ran in that file.
The 1-minute load average before and after each benchmark is recorded (the machine may be shared).

  Shapes (bench/configs/): llama-32k.yaml, a Llama 2 / Mistral proportion scaled down (vocab 32,000, hidden
  256, 4 layers, 8 heads / 4 KV, untied, seq 256, micro-batch 4), and llama-128k.yaml (Llama 3's vocabulary
  128,256, hidden 256, 2 layers, seq 2048, micro-batch 1). The demo model is used by `data` only.

  overhead    recipes/finetune.py (llama-32k, fsdp2, 2 ranks, gloo) vs bench/bare_loop.py, the bare
              tutorial loop on the same model shape, seq_len, batch and ranks; steady-state tokens/s
              after warm-up, --pairs pairs (default 2) in alternating order (A B, B A, ...), median ratio.
              Target >= 0.97x.
  loss        the recipe with train.loss_impl=chunked vs full: step time and peak memory per rank at
              llama-128k (targets: time <= 1.0x, memory <= 0.6x) and llama-32k (time <= 1.0x); --pairs pairs each.
  trainer     useful (trained, non-pad) tokens/s on data/demo/chat.jsonl at llama-32k: the recipe (chat
              format, packing, DDP) vs transformers.Trainer (bench/hf_trainer.py: padding per batch with
              DataCollatorForSeq2Seq, DDP through accelerate), same model, steps and ranks. Target >= 1.3x.
  trl         the same against TRL's SFTTrainer (bench/trl_sft.py: packing and assistant-only loss on),
              run from its own venv (--trl-venv, created with python3 -m venv + pip when missing), with
              peak memory per rank. Target >= 2x.
  dpo         recipes/dpo.py vs TRL's DPOTrainer (bench/trl_dpo.py, TRL's venv) from one model directory of
              llama-32k's shape on data/demo/preference.jsonl (bench/configs/llama-32k-dpo.yaml: ddp, 2 ranks,
              sigmoid, live frozen reference, full fine-tuning): response tokens/s and peak memory per rank,
              --pairs pairs. Target >= 1.3x.
  grpo        recipes/grpo.py vs TRL's GRPOTrainer (bench/trl_grpo.py, TRL's venv) from one model directory of
              llama-32k's shape on data/demo/prompts.jsonl (bench/configs/llama-32k-grpo.yaml: ddp, 2 ranks,
              G 4, 32-token completions, no vLLM): completion tokens trained/s (whole steps: sampling
              included) and peak memory per rank, --pairs pairs. Target >= 1.5x.
  memory      per-rank bytes of parameters + gradients + AdamW state and peak RSS for ddp / fsdp /
              fsdp2 on an ~81M-parameter Llama (bench/memory_probe.py), and the host RAM used while
              loading it from a safetensors directory with 2 ranks vs one copy of the weights.
              Targets: fsdp* training state <= 0.6x ddp; loading <= 1.3x one copy.
  data        llmtrain.data.build (tokenize + pack, cold datasets cache) on a scaled-up copy of
              data/demo/train.jsonl vs the demo's training consumption (tokens/s). Target >= 10x.
  checkpoint  DCP save / load through CheckpointManager and the HF export of an ~106M-parameter model
              on 2 ranks (bench/ckpt_probe.py) vs `dd` of the same size in the same directory.
  dpo_reference  recipes/dpo.py's peak host memory per rank with dpo.precompute_reference vs the live
              frozen reference: full fine-tuning, fsdp2, 2 ranks, ~53M parameters (bench/dpo_memory.py).
              Target <= 0.7x.

--quick makes every benchmark tiny (a smoke run: the figures mean little). The GPU benchmark is a
separate script, bench/gpu.sh (see its header).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (RECIPE, REPO, BenchError, alternating_pairs, best_window_rate, fmt_bytes, median,
                    pair_order, run, steady_tokens_per_sec, torchrun, train_records, useful_tokens_per_sec)

import yaml

BENCH = REPO / "bench"
DEMO = REPO / "configs" / "demo.yaml"
SHAPE_32K = BENCH / "configs" / "llama-32k.yaml"  # real proportions (Llama 2 / Mistral), scaled down
SHAPE_128K = BENCH / "configs" / "llama-128k.yaml"  # Llama 3's vocabulary, seq 2048
NAMES = ["overhead", "loss", "trainer", "trl", "dpo", "grpo", "dpo_reference", "memory", "data", "checkpoint"]
TIMEOUT = 600


def ratio(name: str, value: float | None, target: float | None = None, op: str = ">=", note: str = "") -> dict:
    met = None
    if target is not None and value is not None:
        met = value >= target if op == ">=" else value <= target
    return {"name": name, "value": value, "target": target, "op": op, "met": met, "note": note}


def table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def describe_shape(cfg: Path) -> str:
    c = yaml.safe_load(cfg.read_text())
    m = c["model"]["config"]
    return (f"{cfg.relative_to(REPO)}: vocab {m['vocab_size']:,}, hidden {m['hidden_size']}, {m['num_hidden_layers']} "
            f"layers, {m['num_attention_heads']} heads / {m['num_key_value_heads']} KV, "
            f"{'tied' if m['tie_word_embeddings'] else 'untied'} embeddings, seq {c['data']['seq_len']}, "
            f"micro-batch {c['train']['micro_batch_size']}")


def write_config(path: Path, base: Path, changes: dict) -> Path:
    """A copy of a YAML config with nested changes {"data": {"path": ...}} applied."""
    cfg = yaml.safe_load(base.read_text())
    for section, values in changes.items():
        cfg.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


class Ctx:
    def __init__(self, quick: bool, work: Path, trl_venv: Path, pairs: int):
        self.quick, self.work, self.trl_venv, self.pairs = quick, work, trl_venv, pairs
        # what the tables say: no machine's path in the results
        self.trl_venv_shown = trl_venv.relative_to(REPO) if trl_venv.is_relative_to(REPO) else trl_venv.name

    def dir(self, name: str) -> Path:
        path = self.work / name
        path.mkdir(parents=True, exist_ok=True)
        return path


# -- 1. framework overhead -------------------------------------------------------------------------

def bench_overhead(ctx: Ctx) -> dict:
    steps, warmup, every, pairs = (6, 2, 2, 1) if ctx.quick else (12, 3, 3, ctx.pairs)
    work = ctx.dir("overhead")
    cfg = SHAPE_32K

    def run_recipe(i: int) -> tuple[float, float]:
        out = work / f"recipe_{i}"
        torchrun([RECIPE, "--config", cfg, f"output_dir={out}", f"train.max_steps={steps}",
                  f"log.every_steps={every}", "log.progress=false", "checkpoint.resume=never"],
                 timeout=TIMEOUT, log=work / f"recipe_{i}.log")
        records = train_records(out)
        return (steady_tokens_per_sec(records, warmup),
                max(r["tokens_per_sec"] for r in records if r["step"] > warmup))

    def run_bare(i: int) -> tuple[float, float]:
        res = work / f"bare_{i}.json"
        torchrun([BENCH / "bare_loop.py", "--config", cfg, "--steps", steps, "--warmup", warmup, "--every", every,
                  "--out", res], timeout=TIMEOUT, log=work / f"bare_{i}.log")
        b_res = json.loads(res.read_text())
        return b_res["tokens_per_sec"], max(b_res["window_tokens_per_sec"])

    recipe, bare, ratios_, best = [], [], [], []
    for (a, a_best), (b, b_best) in alternating_pairs(pairs, run_recipe, run_bare):
        recipe.append(a)
        bare.append(b)
        ratios_.append(a / b)
        best.append(a_best / b_best)
    shape = f"{describe_shape(cfg)}, fsdp2, 2 ranks gloo"
    rows = [[f"pair {i + 1} ({pair_order(i)})", f"{a:,.0f}", f"{b:,.0f}", f"{a / b:.3f}",
             f"{r:.3f}"] for i, (a, b, r) in enumerate(zip(recipe, bare, best))]
    rows.append(["**median**", f"{median(recipe):,.0f}", f"{median(bare):,.0f}", f"**{median(ratios_):.3f}**",
                 f"{median(best):.3f}"])
    text = table(["run (A = recipe, B = bare)", "recipe tokens/s", "bare loop tokens/s", "recipe / bare",
                  f"best {every}-step window, recipe / bare"], rows)
    spread = max(ratios_) / min(ratios_)
    text += (f"\n\n{shape}; {steps} steps, the first {warmup} left out; tokens = rows x seq_len. Steady tokens/s "
             f"aggregates the windows after warm-up; the last column compares each run's fastest {every}-step "
             "window (less sensitive to bursts of load from other processes on the machine). "
             f"Spread of the per-pair ratios: {spread:.2f}x. The recipe adds real data loading (packed rows "
             "with position_ids, so attention is block-causal: llmtrain/models/attention.py), a token-weighted loss "
             "(train.loss_impl=chunked, the default) with two all-reduces, grad clipping, a preemption all-reduce "
             "and metrics per step, and it uses "
             "fused AdamW; the bare loop reuses one random batch with plain causal attention and torch's "
             "default (per-parameter) AdamW.")
    return {"title": "Framework overhead: recipe vs bare loop", "table": text,
            "ratios": [ratio("overhead: recipe / bare loop tokens/s", median(ratios_), 0.97),
                       ratio("overhead: best window, recipe / bare", median(best), 0.97)],
            "raw": {"recipe_tokens_per_sec": recipe, "bare_tokens_per_sec": bare, "ratios": ratios_,
                    "best_window_ratios": best, "steps": steps, "warmup": warmup, "log_every": every,
                    "config": str(cfg.relative_to(REPO))}}


# -- 1b. chunked loss vs full logits ---------------------------------------------------------------

def bench_loss(ctx: Ctx) -> dict:
    """train.loss_impl=chunked vs full through the recipe: step time and peak memory per rank."""
    shapes = [("128k", SHAPE_128K, (3, 1) if ctx.quick else (4, 1)),
              ("32k", SHAPE_32K, (6, 2) if ctx.quick else (10, 3))]
    pairs = 1 if ctx.quick else ctx.pairs
    work = ctx.dir("loss")
    rows, ratios_, raw = [], [], {}
    for label, cfg, (steps, warmup) in shapes:
        def run_impl(impl: str):
            def go(i: int) -> tuple[float, float]:
                out = work / f"{label}_{impl}_{i}"
                torchrun([RECIPE, "--config", cfg, f"output_dir={out}", f"train.max_steps={steps}", "log.every_steps=1",
                          "log.progress=false", "checkpoint.resume=never", f"train.loss_impl={impl}"],
                         timeout=TIMEOUT, log=work / f"{label}_{impl}_{i}.log")
                records = train_records(out)
                return steady_tokens_per_sec(records, warmup), max(r["mem_gb"] for r in records)
            return go

        runs = alternating_pairs(pairs, run_impl("chunked"), run_impl("full"))
        time_ratio = median([f[0] / c[0] for c, f in runs])  # chunked step time / full step time
        mem_ratio = median([c[1] / f[1] for c, f in runs])
        for i, (c, f) in enumerate(runs):
            rows.append([f"{label}, pair {i + 1} ({pair_order(i)})", f"{c[0]:,.0f}", f"{f[0]:,.0f}",
                         f"{f[0] / c[0]:.3f}", f"{c[1]:.2f}", f"{f[1]:.2f}", f"{c[1] / f[1]:.2f}"])
        rows.append([f"**{label} median**", "", "", f"**{time_ratio:.3f}**", "", "", f"**{mem_ratio:.2f}**"])
        ratios_.append(ratio(f"loss {label}: chunked / full step time", time_ratio, 1.0, "<="))
        if label == "128k":
            ratios_.append(ratio("loss 128k: chunked / full peak memory per rank", mem_ratio, 0.6, "<="))
        raw[label] = {"runs": runs, "steps": steps, "warmup": warmup, "config": str(cfg.relative_to(REPO)),
                      "shape": describe_shape(cfg)}
    text = table(["run (A = chunked, B = full)", "chunked tokens/s", "full tokens/s", "step time chunked / full",
                  "chunked peak GiB / rank", "full peak GiB / rank", "memory chunked / full"], rows)
    text += ("\n\nThe recipe with train.loss_impl=chunked (A) and full (B), fsdp2, 2 ranks gloo, packed text "
             "(every position trained). Shapes: " + "; ".join(f"**{k}** {v['shape']}, {v['steps']} steps, the first "
                                                         f"{v['warmup']} left out" for k, v in raw.items()) +
             ". Peak memory: the recipe's mem_gb (peak RSS of the process, max over ranks; it includes start-up).")
    return {"title": "Chunked loss vs full logits", "table": text, "ratios": ratios_, "raw": raw}


# -- 2. vs the HF Trainer --------------------------------------------------------------------------

TRL_PINS = ["torch==2.13.0", "trl==1.16.0", "transformers==5.24.0", "datasets", "accelerate", "pyyaml"]


def trl_python(ctx: Ctx) -> Path:
    """TRL is no dependency of llmtrain: its own virtual environment, made once with python3 -m venv."""
    venv = ctx.trl_venv
    if not (venv / "bin" / "torchrun").is_file():
        print(f"creating {venv} for TRL ({' '.join(TRL_PINS)})", flush=True)
        run(["python3", "-m", "venv", venv], timeout=TIMEOUT)
        run([venv / "bin" / "pip", "install", "-q", *TRL_PINS], timeout=3 * TIMEOUT)
    return venv / "bin"


def vs_hf(ctx: Ctx, kind: str) -> dict:
    """Useful tokens/s of the recipe (chat, packed, ddp) vs transformers' Trainer or TRL's SFTTrainer."""
    steps, warmup, window, pairs = (6, 2, 2, 1) if ctx.quick else (10, 3, 3, ctx.pairs)
    work = ctx.dir(kind)
    cfg = write_config(work / "chat.yaml", SHAPE_32K, {"data": {"path": "data/demo/chat.jsonl", "format": "chat",
                                                                "packing": True},
                                                       "parallel": {"strategy": "ddp"}})
    loaded = yaml.safe_load(cfg.read_text())
    micro, seq = loaded["train"]["micro_batch_size"], loaded["data"]["seq_len"]
    other = {"trainer": ("HF Trainer", BENCH / "hf_trainer.py", None),
             "trl": ("TRL SFTTrainer", BENCH / "trl_sft.py", trl_python(ctx) if kind == "trl" else None)}
    name, script, bindir = other[kind]

    def run_recipe(i: int) -> tuple[float, float, float, float]:
        out = work / f"recipe_{i}"
        torchrun([RECIPE, "--config", cfg, f"output_dir={out}", f"train.max_steps={steps}", "log.every_steps=1",
                  "log.progress=false", "checkpoint.resume=never"], timeout=TIMEOUT, log=work / f"recipe_{i}.log")
        records = train_records(out)
        rate, tokens, _ = useful_tokens_per_sec(records, warmup)
        return rate, tokens, best_window_rate([r["elapsed_s"] for r in records],
                                              [r["trained_tokens"] for r in records], warmup, window), \
            max(r["mem_gb"] for r in records)

    def run_hf(i: int) -> dict:
        res = work / f"hf_{i}.json"
        args = [script, "--config", cfg, "--steps", steps, "--warmup", warmup, "--output-dir", work / f"hf_{i}",
                "--out", res]
        env = {"HF_DATASETS_CACHE": str(work / "hf_cache")}
        if bindir is None:
            torchrun(args, timeout=TIMEOUT, log=work / f"hf_{i}.log", env=env)
        else:
            run([bindir / "torchrun", "--standalone", "--nproc_per_node=2", *args], TIMEOUT, env, work / f"hf_{i}.log")
        return json.loads(res.read_text())

    ours, hf, ratios_, our_tok, hf_tok, best, our_mem, hf_mem = [], [], [], [], [], [], [], []
    for (rate, tokens, a_best, mem), hf_info in alternating_pairs(pairs, run_recipe, run_hf):
        ours.append(rate)
        hf.append(hf_info["useful_tokens_per_sec"])
        our_tok.append(tokens / (steps - warmup))
        hf_tok.append(hf_info["trained_tokens"] / (steps - warmup))
        ratios_.append(rate / hf_info["useful_tokens_per_sec"])
        best.append(a_best / best_window_rate(hf_info["step_end_s"], hf_info["step_trained_tokens"], warmup, window))
        our_mem.append(mem)
        hf_mem.append(hf_info["peak_rss_bytes"] / 2**30)
    rows = [[f"pair {i + 1} ({pair_order(i)})", f"{a:,.0f}", f"{b:,.0f}", f"{a / b:.2f}", f"{r:.2f}",
             f"{m:.2f} / {n:.2f}"] for i, (a, b, r, m, n) in enumerate(zip(ours, hf, best, our_mem, hf_mem))]
    rows.append(["**median**", f"{median(ours):,.0f}", f"{median(hf):,.0f}", f"**{median(ratios_):.2f}**",
                 f"{median(best):.2f}", f"{median(our_mem):.2f} / {median(hf_mem):.2f}"])
    pad = 1 - hf_info["real_tokens"] / hf_info["tokens"]
    text = table([f"run (A = recipe, B = {name})", "recipe useful tokens/s", f"{name} useful tokens/s",
                  f"recipe / {name}", f"best {window}-step window, recipe / {name}",
                  "peak GiB / rank, recipe / " + name], rows)
    if kind == "trl":
        how = (f"TRL {hf_info['trl']} SFTTrainer: packing=True (strategy {hf_info['packing_strategy']}: padding-free "
               f"rows with position_ids), assistant_only_loss=True, max_length {seq}, attention "
               f"{hf_info['attn_implementation']}, TRL defaults otherwise, in its own venv ({ctx.trl_venv_shown})")
    else:
        how = f"DataCollatorForSeq2Seq(padding=True): {pad:.0%} of its positions are padding"
    text += (f"\n\nShape: {describe_shape(cfg)}, chat data (data/demo/chat.jsonl), 2 ranks gloo, fp32. Useful = label "
             f"positions that carry a loss (assistant turns), all ranks. Per step (2 ranks x micro-batch {micro}): "
             f"recipe {median(our_tok):,.0f} trained tokens in packed rows of {seq}; {name} "
             f"{median(hf_tok):,.0f}. {name}: {how}; {hf_info['wrapper']} over {hf_info['backend']} "
             f"({hf_info['distributed_type']}; on CPU accelerate ignores FSDP settings, so DDP), "
             f"find_unused_parameters={hf_info['find_unused_parameters']}. The recipe ran DDP too "
             f"(parallel.strategy=ddp), data.format=chat, data.packing=true, train.loss_impl=chunked. {steps} steps, "
             "the "
             "first {warmup} left out; time from rank 0 at the end of each step (the recipe's elapsed_s, a callback's "
             "on_step_end). Peak memory: peak RSS of the process, max over ranks (the recipe's mem_gb). "
             f"Spread of the per-pair ratios: {max(ratios_) / min(ratios_):.2f}x.").replace("{warmup}", str(warmup))
    target = 1.3 if kind == "trainer" else 2.0
    return {"title": f"Useful tokens/s vs {name} (chat SFT)", "table": text,
            "ratios": [ratio(f"{kind}: recipe / {name} useful tokens/s", median(ratios_), target),
                       ratio(f"{kind}: best window, recipe / {name}", median(best), target),
                       ratio(f"{kind}: recipe / {name} peak memory per rank", median(our_mem) / median(hf_mem))],
            "raw": {"recipe_useful_tokens_per_sec": ours, "hf_useful_tokens_per_sec": hf, "ratios": ratios_,
                    "best_window_ratios": best, "recipe_peak_gib": our_mem, "hf_peak_gib": hf_mem,
                    "hf": hf_info, "steps": steps, "warmup": warmup}}


def bench_trainer(ctx: Ctx) -> dict:
    return vs_hf(ctx, "trainer")


def bench_trl(ctx: Ctx) -> dict:
    return vs_hf(ctx, "trl")


# -- 2b. DPO vs TRL's DPOTrainer -------------------------------------------------------------------

SHAPE_DPO = BENCH / "configs" / "llama-32k-dpo.yaml"
DPO_RECIPE = REPO / "recipes" / "dpo.py"
SHAPE_GRPO = BENCH / "configs" / "llama-32k-grpo.yaml"
GRPO_RECIPE = REPO / "recipes" / "grpo.py"


def recipe_vs_trl(ctx: Ctx, name: str, recipe: Path, shape: Path, driver: str, steps: int, warmup: int,
                  window: int, overrides: list[str] | None = None) -> tuple[list[tuple], Path, int, int]:
    """`recipe` and TRL (bench/<driver>, TRL's venv) from one random model directory of llama-32k's shape, ddp,
    2 ranks, --pairs alternating pairs: [(recipe, TRL)] with each side's rate, per-step counts, peak memory and
    fastest `window`-step rate after `warmup` steps; and the config both read."""
    pairs = 1 if ctx.quick else ctx.pairs
    work = ctx.dir(name)
    bindir = trl_python(ctx)
    model_dir = work / "model"
    model_shape = yaml.safe_load(SHAPE_32K.read_text())["model"]["config"]
    run([sys.executable, BENCH / "memory_probe.py", "--export", model_dir, "--shape", json.dumps(model_shape)],
        TIMEOUT)
    cfg = write_config(work / f"{name}.yaml", shape, {"model": {"path": str(model_dir)}})
    data = yaml.safe_load(cfg.read_text())["data"]["path"]

    def run_recipe(i: int) -> dict:
        out = work / f"recipe_{i}"
        torchrun([recipe, "--config", cfg, f"output_dir={out}", f"train.max_steps={steps}", "log.every_steps=1",
                  "log.progress=false", "checkpoint.resume=never", *(overrides or [])], timeout=TIMEOUT,
                 log=work / f"recipe_{i}.log")
        records = train_records(out)
        rate, _, _ = useful_tokens_per_sec(records, warmup)
        tokens = [r["trained_tokens"] for r in records]
        # GRPO: the share of a step spent sampling (absent for other recipes)
        sampling = [r["generation_s"] / r["step_time_s"] for r in records[warmup:] if "generation_s" in r]
        return {"rate": rate, "tokens": tokens, "mem": max(r["mem_gb"] for r in records),
                "sampling_share": median(sampling) if sampling else None,
                "best": best_window_rate([r["elapsed_s"] for r in records], tokens, warmup, window)}

    def run_trl(i: int) -> dict:
        res = work / f"trl_{i}.json"
        run([bindir / "torchrun", "--standalone", "--nproc_per_node=2", BENCH / driver, "--config", cfg,
             "--data", data, "--steps", steps, "--warmup", warmup, "--output-dir", work / f"trl_{i}",
             "--out", res], TIMEOUT, {"HF_DATASETS_CACHE": str(work / "hf_cache")}, work / f"trl_{i}.log")
        info = json.loads(res.read_text())
        info["best"] = best_window_rate(info["step_end_s"], info["step_trained_tokens"], warmup, window)
        return info

    return alternating_pairs(pairs, run_recipe, run_trl), cfg, steps, warmup


@dataclass
class VsTrl:
    """recipe_vs_trl's pairs summed up: the per-pair ratios (rate, fastest window, peak memory) and the table."""
    ratios: list[float]
    best: list[float]
    mem: list[float]
    table: str
    same_tokens: bool


def vs_trl_table(runs: list[tuple], trainer: str, what: str, window: int) -> VsTrl:
    ratios_ = [a["rate"] / b["useful_tokens_per_sec"] for a, b in runs]
    best = [a["best"] / b["best"] for a, b in runs]
    mem = [a["mem"] / (b["peak_rss_bytes"] / 2**30) for a, b in runs]
    rows = [[f"pair {i + 1} ({pair_order(i)})", f"{a['rate']:,.0f}", f"{b['useful_tokens_per_sec']:,.0f}",
             f"{r:.2f}", f"{w:.2f}", f"{a['mem']:.2f} / {b['peak_rss_bytes'] / 2**30:.2f}"]
            for i, ((a, b), r, w) in enumerate(zip(runs, ratios_, best))]
    rows.append(["**median**", f"{median([a['rate'] for a, _ in runs]):,.0f}",
                 f"{median([b['useful_tokens_per_sec'] for _, b in runs]):,.0f}", f"**{median(ratios_):.2f}**",
                 f"{median(best):.2f}", f"ratio {median(mem):.2f}"])
    text = table([f"run (A = recipe, B = TRL {trainer})", f"recipe {what}/s", f"TRL {what}/s", "recipe / TRL",
                  f"best {window}-step window, recipe / TRL", "peak GiB / rank, recipe / TRL"], rows)
    same = all(x["tokens"] == y["step_trained_tokens"] for x, y in runs)
    return VsTrl(ratios_, best, mem, text, same)


def bench_dpo(ctx: Ctx) -> dict:
    """Useful (response) tokens/s of recipes/dpo.py vs TRL's DPOTrainer from one model directory, ddp, 2 ranks."""
    window = 2 if ctx.quick else 5
    runs, cfg, steps, warmup = recipe_vs_trl(ctx, "dpo", DPO_RECIPE, SHAPE_DPO, "trl_dpo.py",
                                             *((6, 2) if ctx.quick else (20, 5)), window)
    c = yaml.safe_load(cfg.read_text())
    v = vs_trl_table(runs, "DPOTrainer", "response tokens", window)
    a, b = runs[-1]
    text = v.table + (
        f"\n\nShape: {describe_shape(SHAPE_32K).split(', seq')[0]}; one random model "
        f"directory (bench/memory_probe.py --export) that both sides start from, for the policy and the frozen "
        f"reference. Pairs: {c['data']['path']} (text form), max length {c['data']['seq_len']}, micro-batch "
        f"{c['train']['micro_batch_size']} pairs per rank (chosen + rejected rows in one forward, padded to the "
        f"longest row), 2 ranks gloo, DDP, fp32, sigmoid loss, beta {c['dpo']['beta']}, live frozen reference, "
        f"full fine-tuning. Useful = response tokens of chosen and rejected rows (what "
        f"carries a log-prob), all ranks: per step the two sides counted "
        f"{'the same tokens (same pairs in the same order)' if v.same_tokens else 'different tokens'}, median "
        f"{median(a['tokens'][warmup:]):,.0f}. Recipe: recipes/dpo.py, train.loss_impl default. TRL {b['trl']} "
        f"DPOTrainer: activation checkpointing {b['activation_checkpointing']} and bf16={b['bf16']} (TRL turns both "
        f"on by default), precompute_ref_log_probs={b['precompute_ref_log_probs']}, padding_free="
        f"{b['padding_free']} (TRL's defaults), truncation {b['truncation_mode']}, optimizer {b['optim']}, "
        f"attention {b['attn_implementation']}, {b['wrapper']} with find_unused_parameters="
        f"{b['find_unused_parameters']} (transformers' default without gradient checkpointing); TRL defaults "
        f"otherwise, in its own venv ({ctx.trl_venv_shown}). {steps} steps, the first {warmup} left out; time from "
        f"rank 0 at the end of each step. Peak memory: peak RSS of the process, max over ranks. Spread of the per-pair "
        f"ratios: {max(v.ratios) / min(v.ratios):.2f}x.")
    return {"title": "DPO: response tokens/s vs TRL DPOTrainer", "table": text,
            "ratios": [ratio("dpo: recipe / TRL DPOTrainer response tokens/s", median(v.ratios), 1.3),
                       ratio("dpo: best window, recipe / TRL DPOTrainer", median(v.best), 1.3),
                       ratio("dpo: recipe / TRL DPOTrainer peak memory per rank", median(v.mem))],
            "raw": {"runs": runs, "ratios": v.ratios, "best_window_ratios": v.best, "memory_ratios": v.mem,
                    "same_tokens": v.same_tokens, "steps": steps, "warmup": warmup,
                    "config": str(SHAPE_DPO.relative_to(REPO))}}


def bench_grpo(ctx: Ctx) -> dict:
    """Completion tokens trained per second of recipes/grpo.py vs TRL's GRPOTrainer (generation, rewards and
    the update: the whole step), one model directory, ddp, 2 ranks."""
    window = 2 if ctx.quick else 3
    runs, cfg, steps, warmup = recipe_vs_trl(ctx, "grpo", GRPO_RECIPE, SHAPE_GRPO, "trl_grpo.py",
                                             *((5, 2) if ctx.quick else (12, 3)), window)
    c = yaml.safe_load(cfg.read_text())
    g = c["grpo"]
    v = vs_trl_table(runs, "GRPOTrainer", "completion tokens trained", window)
    a, b = runs[-1]
    per_rank = c["train"]["micro_batch_size"]
    gen = a["sampling_share"]
    text = v.table + (
        f"\n\nShape: {describe_shape(SHAPE_32K).split(', seq')[0]}; one random model directory "
        f"(bench/memory_probe.py --export) that both sides start from. Prompts: {c['data']['path']} (text), "
        f"{per_rank} completions per rank a step ({per_rank // g['num_generations']} "
        f"prompts x G {g['num_generations']}), max_completion_length {g['max_completion_length']}, temperature "
        f"{g['temperature']}, loss_type {g['loss_type']}, beta {g['beta']}, reward {', '.join(g['reward_funcs'])}, "
        f"2 ranks gloo, DDP, fp32, full fine-tuning, no vLLM on either side. Trained = completion tokens up to and "
        f"including EOS (what carries the loss), all ranks; the random model rarely samples EOS, so nearly every "
        f"completion runs to its maximum on both sides (median per step: recipe "
        f"{median(a['tokens'][warmup:]):,.0f}, TRL {median(b['step_trained_tokens'][warmup:]):,.0f}). A step is "
        f"the whole of it: sampling, rewards, the old/ref log-probs when needed, the update; in the recipe "
        f"sampling took {gen:.0%} of the step (median). TRL {b['trl']} GRPOTrainer: gradient checkpointing "
        f"{b['gradient_checkpointing']} and bf16={b['bf16']} (TRL turns both on by default), use_vllm="
        f"{b['use_vllm']}, generation_batch_size {b['generation_batch_size']}, optimizer {b['optim']}, attention "
        f"{b['attn_implementation']}; TRL defaults otherwise, in its own venv ({ctx.trl_venv_shown}). {steps} "
        f"steps, the first {warmup} left out; time from rank 0 at the end of each step. Peak memory: peak RSS of the "
        f"process, max over ranks. Spread of the per-pair ratios: {max(v.ratios) / min(v.ratios):.2f}x.")
    return {"title": "GRPO: completion tokens trained/s vs TRL GRPOTrainer", "table": text,
            "ratios": [ratio("grpo: recipe / TRL GRPOTrainer completion tokens trained/s", median(v.ratios), 1.5),
                       ratio("grpo: best window, recipe / TRL GRPOTrainer", median(v.best), 1.5),
                       ratio("grpo: recipe / TRL GRPOTrainer peak memory per rank", median(v.mem))],
            "raw": {"runs": runs, "ratios": v.ratios, "best_window_ratios": v.best, "memory_ratios": v.mem,
                    "steps": steps, "warmup": warmup, "config": str(SHAPE_GRPO.relative_to(REPO))}}


# -- 3. memory -------------------------------------------------------------------------------------

MEM_SHAPE = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 12,
             "num_key_value_heads": 12, "vocab_size": 32000, "tie_word_embeddings": True,
             "max_position_embeddings": 2048}
MEM_SHAPE_QUICK = {**MEM_SHAPE, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 4}


def bench_memory(ctx: Ctx) -> dict:
    work = ctx.dir("memory")
    shape = MEM_SHAPE_QUICK if ctx.quick else MEM_SHAPE
    model_dir = work / "model"
    out, _ = run([sys.executable, BENCH / "memory_probe.py", "--export", model_dir, "--shape", json.dumps(shape)],
                 timeout=TIMEOUT)
    exported = json.loads(out.strip().splitlines()[-1])
    weights = exported["bytes"]
    per = {}
    for strategy in ("ddp", "fsdp", "fsdp2"):
        res = work / f"{strategy}.json"
        torchrun([BENCH / "memory_probe.py", "--model", model_dir, "--strategy", strategy, "--out", res],
                 timeout=TIMEOUT, log=work / f"{strategy}.log")
        per[strategy] = json.loads(res.read_text())["ranks"]
    state = {s: max(r["params_bytes"] + r["grads_bytes"] + r["optim_bytes"] for r in ranks) for s, ranks in per.items()}
    rows = []
    for s, ranks in per.items():
        r0 = ranks[0]
        rows.append([s, fmt_bytes(r0["params_bytes"]), fmt_bytes(r0["grads_bytes"]), fmt_bytes(r0["optim_bytes"]),
                     fmt_bytes(state[s]), f"{state[s] / state['ddp']:.2f}",
                     " / ".join(fmt_bytes(r["peak_rss_bytes"]) for r in ranks),
                     f"{max(r['peak_rss_bytes'] for r in ranks) / max(r['peak_rss_bytes'] for r in per['ddp']):.2f}"])
    text = table(["strategy", "params / rank", "grads / rank", "AdamW state / rank", "training state / rank",
                  "vs ddp", "peak RSS rank 0 / rank 1", "peak RSS vs ddp"], rows)
    n = per["ddp"][0]["n_params"]
    text += (f"\n\n{n / 1e6:.1f}M-parameter Llama ({shape['hidden_size']} hidden, {shape['num_hidden_layers']} layers, "
             f"vocab {shape['vocab_size']}, tied embeddings), fp32, 2 ranks on CPU, loaded from a safetensors "
             "directory, one AdamW step (micro-batch 1 x 128 tokens). Bytes are sums of this rank's local "
             "tensors (FSDP2: DTensor local shards; FSDP1: flat parameters). Peak RSS (getrusage) includes "
             "the ~0.35 GiB of imports, the loading peak, activations, all-gather buffers and allocator slack.")
    load_rows, load_ratios = [], []
    for s, ranks in per.items():
        total = sum(r["load_peak_bytes"] for r in ranks)
        anon = sum(r["load_anon_peak_bytes"] for r in ranks)
        shards = sum(r["params_bytes_after_load"] for r in ranks)
        load_rows.append([s, " / ".join(fmt_bytes(r["load_peak_bytes"]) for r in ranks), f"{total / weights:.2f}",
                          f"{anon / weights:.2f}", fmt_bytes(shards), f"{(anon - shards) / weights:.2f}"])
        if s in ("fsdp", "fsdp2"):  # ddp keeps a full replica per rank by design: 2 copies at least
            load_ratios += [ratio(f"memory: loading {s}, private host RAM incl. shards / one copy", anon / weights,
                                  1.3, "<=", "RssAnon peak increase summed over both ranks; on CPU the shards "
                                  "live in host RAM"),
                            ratio(f"memory: loading {s}, private host RAM beyond shards / one copy",
                                  (anon - shards) / weights, 1.3, "<=",
                                  "what a GPU run would hold in host RAM (its shards are on the GPUs)")]
    text += "\n\nLoading (" + fmt_bytes(weights) + " of safetensors weights = one copy):\n\n" + table(
        ["strategy", "VmHWM increase rank 0 / rank 1", "VmHWM sum / one copy", "RssAnon sum / one copy",
         "loaded params, both ranks", "(RssAnon sum - loaded params) / one copy"], load_rows)
    text += ("\n\nVmHWM is reset just before parallelize + load_weights and read after; the increase is over the "
             "RSS just before. It counts the safetensors file pages each rank maps to read its weights: page cache, "
             "shared by the ranks and reclaimable, so the sum counts it once per rank. RssAnon (sampled every "
             "2 ms) is the private memory and the figure the targets use. On CPU the loaded parameters "
             "themselves live in host RAM (one copy over both ranks with fsdp/fsdp2, one per rank with ddp).")
    return {"title": "Memory per rank (ddp / fsdp / fsdp2)", "table": text,
            "ratios": [ratio("memory: fsdp training state / ddp", state["fsdp"] / state["ddp"], 0.6, "<="),
                       ratio("memory: fsdp2 training state / ddp", state["fsdp2"] / state["ddp"], 0.6, "<="),
                       *load_ratios],
            "raw": {"per_rank": per, "weights_bytes": weights, "n_params": n, "shape": shape}}


# -- 4. data pipeline ------------------------------------------------------------------------------

def bench_data(ctx: Ctx) -> dict:
    work = ctx.dir("data")
    scale, stream_rows = (1, 200) if ctx.quick else (10, 3000)
    # The demo's consumption (the overhead benchmark runs a larger shape): a short demo run of its own.
    out = work / "demo"
    steps, warmup = (6, 2) if ctx.quick else (20, 10)
    torchrun([RECIPE, "--config", DEMO, f"output_dir={out}", f"train.max_steps={steps}", "log.every_steps=2",
              "log.progress=false", "checkpoint.resume=never"], timeout=TIMEOUT, log=work / "demo.log")
    train_tps = steady_tokens_per_sec(train_records(out), warmup)
    demo_source = f"a {steps}-step demo run of its own (first {warmup} steps left out)"
    cache = work / "hf_cache"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir()
    res = work / "data.json"
    run([sys.executable, BENCH / "data_probe.py", "--src", "data/demo/train.jsonl", "--scale", scale,
         "--workdir", work / "corpus", "--streaming-rows", stream_rows, "--out", res], timeout=TIMEOUT,
        env={"HF_DATASETS_CACHE": str(cache)}, log=work / "data.log")
    d = json.loads(res.read_text())
    build_ratio = d["row_tokens_per_sec"] / train_tps
    stream_ratio = d["stream_row_tokens_per_sec"] / (train_tps / 2)
    rows = [["map-style build (load + tokenize + pack), 1 process", f"{d['row_tokens_per_sec']:,.0f}",
             f"{train_tps:,.0f} (2 ranks)", f"**{build_ratio:.1f}**"],
            ["streaming rows (tokenize + pack on the fly), 1 rank", f"{d['stream_row_tokens_per_sec']:,.0f}",
             f"{train_tps / 2:,.0f} (per rank)", f"{stream_ratio:.1f}"]]
    text = table(["pipeline", "tokens/s", "demo training consumes, tokens/s", "ratio"], rows)
    text += (f"\n\n{d['records']:,} documents ({d['corpus_bytes'] / 2**20:.1f} MiB: data/demo/train.jsonl x {scale}), "
             f"format text, seq_len {d['seq_len']}, packing, cold datasets cache: {d['rows']:,} rows "
             f"({d['real_tokens']:,} real tokens) in {d['build_s']:.1f} s. Streaming: the first "
             f"{d['stream_rows']:,} rows (shuffle buffer 1000). Tokens are rows x seq_len on both sides. "
             f"Consumption: the recipe's steady tokens/s on configs/demo.yaml, from {demo_source}. "
             "Streaming tokenizes in the training loop of every rank (not overlapped with compute), so it "
             f"costs about 1/{stream_ratio:.0f} of the step time.")
    return {"title": "Data pipeline vs training consumption", "table": text,
            "ratios": [ratio("data: build tokens/s / demo training tokens/s", build_ratio, 10.0),
                       ratio("data: streaming per rank / training per rank", stream_ratio, None)],
            "raw": {**d, "demo_tokens_per_sec": train_tps}}


# -- 5. checkpoint ---------------------------------------------------------------------------------

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


def bench_checkpoint(ctx: Ctx) -> dict:
    work = ctx.dir("checkpoint")
    shape = CKPT_SHAPE_QUICK if ctx.quick else CKPT_SHAPE
    res = work / "ckpt.json"
    torchrun([BENCH / "ckpt_probe.py", "--dir", work, "--shape", json.dumps(shape), "--out", res], timeout=TIMEOUT,
             log=work / "ckpt.log")
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


# -- 6. DPO: precomputed reference log-probs vs the live reference -----------------------------------

def bench_dpo_reference(ctx: Ctx) -> dict:
    import dpo_memory

    res = dpo_memory.measure(ctx.dir("dpo_reference"), quick=ctx.quick)
    return {"title": "DPO: precomputed reference log-probs vs the live frozen reference, peak memory",
            "table": res["table"],
            "ratios": [ratio("dpo: peak host memory per rank, precompute_reference / live reference", res["ratio"],
                             0.7, "<=", "full fine-tuning, fsdp2, 2 ranks (bench/dpo_memory.py)")],
            "raw": res["raw"]}


BENCHES = {"overhead": bench_overhead, "loss": bench_loss, "trainer": bench_trainer, "trl": bench_trl,
           "dpo": bench_dpo, "grpo": bench_grpo,
           "dpo_reference": bench_dpo_reference, "memory": bench_memory, "data": bench_data,
           "checkpoint": bench_checkpoint}


# -- report ----------------------------------------------------------------------------------------

def machine() -> dict:
    info = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        mem = Path("/proc/meminfo").read_text().split()
        info["mem_gib"] = round(int(mem[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        import importlib.metadata as md

        info.update({k: md.version(k) for k in ("torch", "transformers", "accelerate", "datasets")})
    except Exception:
        pass
    return info


def fmt_ratio(r: dict) -> str:
    return "n/a" if r["value"] is None else f"{r['value']:.3g}x"


def summary(results: dict) -> str:
    rows = []
    for name, res in results.items():
        if "error" in res:
            rows.append([name, "failed", "", "", res["error"].splitlines()[0][:100]])
            continue
        for r in res["ratios"]:
            target = "" if r["target"] is None else f"{r['op']} {r['target']}x"
            met = {True: "met", False: "**not met**", None: "(no target)"}[r["met"]]
            rows.append([r["name"], fmt_ratio(r), target, met, r.get("note", "")])
    return table(["ratio", "measured", "target", "", "note"], rows)


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = [r for res in results.values() if "ratios" in res for r in res["ratios"] if r["value"]]
    if not items:
        return
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(items) + 1.6))
    ys = list(range(len(items)))[::-1]
    colors = {True: "#2e7d32", False: "#c62828", None: "#78909c"}
    ax.barh(ys, [r["value"] for r in items], color=[colors[r["met"]] for r in items], height=0.6)
    for y, r in zip(ys, items):
        ax.text(max(r["value"], r["target"] or 0) * 1.06, y, fmt_ratio(r), va="center", fontsize=8)
        if r["target"] is not None:
            ax.plot([r["target"]] * 2, [y - 0.4, y + 0.4], color="black", linewidth=2)
    ax.axvline(1.0, color="#999", linewidth=0.8, linestyle=":")
    ax.set_yticks(ys, [r["name"] for r in items], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(right=max(max(r["value"], r["target"] or 0) for r in items) * 3)
    ax.set_xlabel("ratio (log scale); black tick = target; green met, red not met, grey no target")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(
                                    __doc__.splitlines()[5:]))
    p.add_argument("--quick", action="store_true", help="tiny versions of every benchmark (a smoke run)")
    p.add_argument("--only", nargs="+", choices=NAMES, metavar="NAME", help=f"run only these: {', '.join(NAMES)}")
    p.add_argument("--results-dir", type=Path, default=BENCH / "results")
    p.add_argument("--pairs", type=int, default=2,
                   help="A B / B A pairs of the overhead, loss, trainer and trl benchmarks (1 on a busy machine)")
    p.add_argument("--trl-venv", type=Path, default=REPO / ".venv-trl",
                   help="virtual environment for TRL (the trl benchmark); created when missing")
    p.add_argument("--keep", action="store_true", help="keep the working directory (logs, runs) in outputs/")
    args = p.parse_args(argv)
    names = [n for n in NAMES if not args.only or n in args.only]
    (REPO / "outputs").mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-", dir=REPO / "outputs"))
    ctx = Ctx(args.quick, work, args.trl_venv, args.pairs)
    started = time.time()
    results: dict = {}
    load = [os.getloadavg()[0]]
    try:
        for name in names:
            t0 = time.perf_counter()
            print(f"\n## {name}{' (quick)' if args.quick else ''}\n", flush=True)
            try:
                res = BENCHES[name](ctx)
            except Exception as e:  # one failed benchmark is reported; the others still run
                import traceback

                res = {"title": name, "error": f"{type(e).__name__}: {e}"}
                print(f"FAILED: {res['error'][-3000:]}", flush=True)
                if not isinstance(e, BenchError):
                    traceback.print_exc()
            res["seconds"] = round(time.perf_counter() - t0, 1)
            res["finished"] = dt.datetime.now().isoformat(timespec="seconds")
            load.append(os.getloadavg()[0])
            if "table" in res:
                print(f"### {res['title']}\n\n{res['table']}\n\n({res['seconds']:.0f} s)", flush=True)
            results[name] = res
    finally:
        if args.keep:
            print(f"\nworking directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    date = dt.date.today().isoformat()
    stem = f"{date}-quick" if args.quick else date
    args.results_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.results_dir / f"{stem}.json"
    doc = json.loads(json_path.read_text()) if json_path.is_file() else {"benchmarks": {}}
    doc["benchmarks"].update(results)
    doc.update({"date": date, "quick": args.quick, "machine": machine(),
                "command": "python bench/run.py" + (" --quick" if args.quick else "") +
                           (f" --only {' '.join(args.only)}" if args.only else ""),
                "last_run": {"benchmarks": names, "seconds": round(time.time() - started, 1),
                             "load_average_1min": [round(x, 2) for x in load]}})
    json_path.write_text(json.dumps(doc, indent=1))
    png = json_path.with_suffix(".png")
    if importlib.util.find_spec("matplotlib") is None:  # the picture is extra; the results are the JSON and tables
        print("\nno picture: drawing it needs matplotlib, the llmtrain[plot] extra (pip install -e '.[plot]')")
        png = None
    else:
        plot(doc["benchmarks"], png, f"llmtrain bench {stem}: {doc['machine'].get('cpus')} CPU cores "
                                     f"({doc['machine'].get('cpu', '?')}), ratios measured side by side")
    print(f"\n## Summary ({time.time() - started:.0f} s; 1-min load average {' -> '.join(f'{x:.1f}' for x in load)})\n")
    print(summary(results))
    print(f"\nwrote {json_path.relative_to(REPO) if json_path.is_relative_to(REPO) else json_path}"
          + (f" and {png.name}" if png else ""))
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
