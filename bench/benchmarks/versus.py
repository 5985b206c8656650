"""The recipe against transformers' Trainer and TRL's trainers (TRL in its own venv): what `trainer`, `trl`, `dpo`
and `grpo` share."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from benchmarks.base import BASELINES, BENCH, Ctx, SHAPE_32K, TIMEOUT, describe_shape, ratio, table, write_config
from benchmarks.memory import MEMORY_PROBE
from common import (RECIPE, REPO, alternating_pairs, best_window_rate, median, pair_order, run, torchrun,
                    train_records, useful_tokens_per_sec)


TRL_PINS = ["torch==2.13.0", "trl==1.16.0", "transformers==5.24.0", "datasets", "accelerate", "pyyaml", "pillow"]


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
    other = {"trainer": ("HF Trainer", BASELINES / "hf_trainer.py", None),
             "trl": ("TRL SFTTrainer", BASELINES / "trl_sft.py", trl_python(ctx) if kind == "trl" else None)}
    name, script, bindir = other[kind]

    def run_recipe(i: int) -> dict:
        out = work / f"recipe_{i}"
        torchrun([RECIPE, "--config", cfg, f"output_dir={out}", f"train.max_steps={steps}", "log.every_steps=1",
                  "log.progress=false", "checkpoint.resume=never"], timeout=TIMEOUT, log=work / f"recipe_{i}.log")
        records = train_records(out)
        rate, tokens, _ = useful_tokens_per_sec(records, warmup)
        return {"rate": rate, "tokens": tokens, "mem": max(r["mem_gb"] for r in records),
                "best": best_window_rate([r["elapsed_s"] for r in records], [r["trained_tokens"] for r in records],
                                         warmup, window)}

    def run_hf(i: int) -> dict:
        res = work / f"hf_{i}.json"
        args = [script, "--config", cfg, "--steps", steps, "--warmup", warmup, "--output-dir", work / f"hf_{i}",
                "--out", res]
        torchrun(args, timeout=TIMEOUT, log=work / f"hf_{i}.log", env={"HF_DATASETS_CACHE": str(work / "hf_cache")},
                 bindir=bindir)
        return json.loads(res.read_text())

    runs = alternating_pairs(pairs, run_recipe, run_hf)
    ours, hf = [a["rate"] for a, _ in runs], [b["useful_tokens_per_sec"] for _, b in runs]
    ratios_ = [a / b for a, b in zip(ours, hf)]
    our_tok = [a["tokens"] / (steps - warmup) for a, _ in runs]
    hf_tok = [b["trained_tokens"] / (steps - warmup) for _, b in runs]
    best = [a["best"] / best_window_rate(b["step_end_s"], b["step_trained_tokens"], warmup, window) for a, b in runs]
    our_mem, hf_mem = [a["mem"] for a, _ in runs], [b["peak_rss_bytes"] / 2**30 for _, b in runs]
    hf_info = runs[-1][1]
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


SHAPE_DPO = BENCH / "configs" / "llama-32k-dpo.yaml"
DPO_RECIPE = REPO / "recipes" / "dpo.py"
SHAPE_GRPO = BENCH / "configs" / "llama-32k-grpo.yaml"
GRPO_RECIPE = REPO / "recipes" / "grpo.py"


@dataclass
class Versus:
    """recipe_vs_trl's runs: --pairs alternating (recipe, TRL) pairs of results, and the config both read."""
    runs: list[tuple[dict, dict]]
    config: Path


def recipe_vs_trl(ctx: Ctx, name: str, recipe: Path, shape: Path, driver: str, steps: int, warmup: int,
                  window: int, changes: dict | None = None,
                  warm: Callable[[Path], Path] | None = None,
                  in_trl_venv: bool = False) -> Versus:
    """`recipe` and TRL (bench/baselines/<driver>, TRL's venv) from one random model directory of llama-32k's shape
    (or the directory `warm` makes of it, e.g. a short SFT), ddp, 2 ranks: each side's rate, per-step counts, peak
    memory and fastest `window`-step rate after `warmup` steps, from the config both read (`shape` with `changes`,
    e.g. {"grpo": {"max_completion_length": 256}}, applied); in_trl_venv: the recipe runs in TRL's venv too."""
    pairs = 1 if ctx.quick else ctx.pairs
    work = ctx.dir(name)
    bindir = trl_python(ctx)
    model_dir = work / "model"
    model_shape = yaml.safe_load(SHAPE_32K.read_text())["model"]["config"]
    run([sys.executable, MEMORY_PROBE, "--export", model_dir, "--shape", json.dumps(model_shape)],
        TIMEOUT)
    model_dir = warm(model_dir) if warm else model_dir
    cfg = write_config(work / f"{name}.yaml", shape, {**(changes or {}), "model": {"path": str(model_dir)}})
    data = yaml.safe_load(cfg.read_text())["data"]["path"]

    def run_recipe(i: int) -> dict:
        out = work / f"recipe_{i}"
        args = [recipe, "--config", cfg, f"output_dir={out}", f"train.max_steps={steps}", "log.every_steps=1",
                "log.progress=false", "checkpoint.resume=never"]
        torchrun(args, timeout=TIMEOUT, log=work / f"recipe_{i}.log", bindir=bindir if in_trl_venv else None)
        records = train_records(out)
        rate, _, _ = useful_tokens_per_sec(records, warmup)
        tokens = [r["trained_tokens"] for r in records]
        # GRPO: the share of a step spent sampling (absent for other recipes)
        sampling = [r["generation_s"] / r["step_time_s"] for r in records[warmup:] if "generation_s" in r]
        return {"rate": rate, "tokens": tokens, "mem": max(r["mem_gb"] for r in records),
                "sampling_share": median(sampling) if sampling else None,
                "best": best_window_rate([r["elapsed_s"] for r in records], tokens, warmup, window)}

    def run_trl(i: int) -> dict:
        return run_driver(bindir, driver, cfg, data, steps, warmup, window, work / f"trl_{i}")

    return Versus(alternating_pairs(pairs, run_recipe, run_trl), cfg)


def run_driver(bindir: Path, driver: str, cfg: Path, data: Path | str, steps: int, warmup: int, window: int,
               out: Path) -> dict:
    """bench/baselines/<driver> on 2 ranks from `bindir` (TRL's venv), writing into `out` (its .json, .log next to
    it): the results it reports, with its fastest `window`-step rate after `warmup` steps as "best"."""
    res = out.with_suffix(".json")
    torchrun([BASELINES / driver, "--config", cfg, "--data", data, "--steps", steps, "--warmup", warmup,
              "--output-dir", out, "--out", res], timeout=TIMEOUT, log=out.with_suffix(".log"),
             env={"HF_DATASETS_CACHE": str(out.parent / "hf_cache")}, bindir=bindir)
    info = json.loads(res.read_text())
    info["best"] = best_window_rate(info["step_end_s"], info["step_trained_tokens"], warmup, window)
    return info


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


def per_sec(step_end_s: list[float], per_step: int, warmup: int) -> float:
    """Rows (or pairs) per second over the steps after `warmup` (step_end_s: each step's end, one clock)."""
    return per_step * (len(step_end_s) - warmup) / (step_end_s[-1] - step_end_s[warmup - 1])


@dataclass
class Counted:
    """What one recipe_vs_trl benchmark counts per step (rows or pairs, its TRL driver counting the same) and how its
    table and ratios name it."""
    name: str       # the benchmark's name (bench/run.py --only NAME) and its work folder
    recipe: Path
    shape: Path
    driver: str     # bench/baselines/<driver>, which counts `unit` as its "trained"
    trainer: str    # TRL's class, for the table
    unit: str       # "pairs" or "rows"
    target: float   # the rate ratio asked for
    setup: Callable[[dict], str]  # the config -> the rest of the sentence on what both sides train
    # the recipe in TRL's venv too: the same packages on both sides (peak memory within a few % of TRL's, where
    # what transformers imports from this repo's dev extras, e.g. scipy for lm_eval, would count)
    in_trl_venv: bool = False


def counted_vs_trl(ctx: Ctx, c: Counted) -> dict:
    """`unit`/s of c.recipe vs TRL's c.trainer from one model directory, ddp, 2 ranks (recipe_vs_trl), with peak
    memory per rank: the table, the ratios (>= c.target, memory <= 1x) and the raw numbers."""
    steps, warmup, window = (6, 2, 2) if ctx.quick else (20, 5, 5)
    versus = recipe_vs_trl(ctx, c.name, c.recipe, c.shape, c.driver, steps, warmup, window, in_trl_venv=c.in_trl_venv)
    runs, conf = versus.runs, yaml.safe_load(versus.config.read_text())
    per_step = conf["train"]["micro_batch_size"] * conf["train"]["grad_accum_steps"] * 2  # 2 ranks
    work = ctx.dir(c.name)
    ours = [per_sec([r["elapsed_s"] for r in train_records(Path(work / f"recipe_{i}"))], per_step, warmup)
            for i in range(len(runs))]
    theirs = [b["useful_tokens_per_sec"] for _, b in runs]  # the driver counts c.unit
    speed = [a / b for a, b in zip(ours, theirs)]
    mem = [a["mem"] / (b["peak_rss_bytes"] / 2**30) for a, b in runs]
    rows = [f"| pair {i + 1} ({pair_order(i)}) | {a:,.2f} | {b:,.2f} | {s:.2f} | {run_[0]['mem']:.2f} / "
            f"{run_[1]['peak_rss_bytes'] / 2**30:.2f} |"
            for i, (a, b, s, run_) in enumerate(zip(ours, theirs, speed, runs))]
    b = runs[-1][1]
    text = "\n".join([f"| | recipe {c.unit}/s | TRL {c.unit}/s | ratio | peak GiB per rank (recipe / TRL) |",
                      "| --- | --- | --- | --- | --- |", *rows,
                      f"| **median** | {median(ours):,.2f} | {median(theirs):,.2f} | **{median(speed):.2f}** | "
                      f"{median(mem):.2f}x |"]) + (
        f"\n\nShape: {describe_shape(SHAPE_32K).split(', seq')[0]}; one random causal-LM directory "
        f"(bench/benchmarks/memory/probe.py --export){c.setup(conf)}. TRL {b['trl']} {c.trainer}: gradient "
        f"checkpointing {b['gradient_checkpointing']} and bf16={b['bf16']} (TRL turns both on by default), optimizer "
        f"{b['optim']}, "
        f"attention {b['attn_implementation']}, {b['wrapper']}; TRL defaults otherwise, in its own venv "
        f"({ctx.trl_venv_shown}). {steps} steps, the first {warmup} left out; time from rank 0 at the end of each "
        f"step. Peak memory: peak RSS of the process, max over ranks."
        + (" The recipe ran in TRL's venv too (the same packages on both sides)." if c.in_trl_venv else ""))
    return {"table": text,
            "ratios": [ratio(f"{c.name}: recipe / TRL {c.trainer} {c.unit}/s", median(speed), c.target),
                       ratio(f"{c.name}: recipe / TRL {c.trainer} peak memory per rank", median(mem), 1.0, "<=")],
            "raw": {"runs": runs, f"recipe_{c.unit}_per_sec": ours, f"trl_{c.unit}_per_sec": theirs, "ratios": speed,
                    "memory_ratios": mem, "steps": steps, "warmup": warmup, "config": str(c.shape.relative_to(REPO))}}
