"""`vlm` (python bench/run.py --only vlm): image chat SFT of a tiny Qwen2.5-VL with Qwen's vocabulary (151,936
ids; bench/benchmarks/vlm/make_model.py), recipes/finetune.py against TRL's SFTTrainer
(bench/baselines/trl_sft_vlm.py, its own venv, --trl-venv) on the same model directory, processor, records (chat
about coloured images of several sizes, made beside the model), micro-batch and ranks (ddp, 2), the vision tower
frozen on both sides: trained tokens per second and peak memory per rank. Targets: >= 2x, memory <= 1x."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from benchmarks.base import Ctx, TIMEOUT, ratio
from benchmarks.versus import run_driver, trl_python, vs_trl_table
from common import RECIPE, alternating_pairs, best_window_rate, median, run, torchrun, train_records, \
    useful_tokens_per_sec

RECORDS = 256
SETTINGS = {"data": {"format": "chat", "seq_len": 128, "packing": False},
            "parallel": {"strategy": "ddp"},
            "train": {"micro_batch_size": 8, "grad_accum_steps": 1, "lr": 1.0e-3, "warmup_steps": 2,
                      "lr_schedule": "cosine", "weight_decay": 0.0, "max_grad_norm": 1.0, "seed": 42}}


def bench(ctx: Ctx) -> dict:
    steps, warmup, window = (6, 2, 2) if ctx.quick else (20, 5, 5)
    work = ctx.dir("vlm")
    bindir = trl_python(ctx)
    run([sys.executable, Path(__file__).parent / "make_model.py", work, RECORDS], TIMEOUT)
    data = work / "data" / "train.jsonl"
    cfg = work / "vlm.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": str(work / "model"), "trust_remote_code": True},
                                   **SETTINGS, "data": {**SETTINGS["data"], "path": str(data)}}, sort_keys=False))

    def run_recipe(i: int) -> dict:
        out = work / f"recipe_{i}"
        torchrun([RECIPE, "--config", cfg, f"output_dir={out}", f"train.max_steps={steps}", "log.every_steps=1",
                  "log.progress=false", "checkpoint.resume=never"], timeout=TIMEOUT, log=work / f"recipe_{i}.log")
        records = train_records(out)
        tokens = [r["trained_tokens"] for r in records]
        return {"rate": useful_tokens_per_sec(records, warmup)[0], "tokens": tokens,
                "mem": max(r["mem_gb"] for r in records),
                "best": best_window_rate([r["elapsed_s"] for r in records], tokens, warmup, window)}

    def run_trl(i: int) -> dict:
        return run_driver(bindir, "trl_sft_vlm.py", cfg, data, steps, warmup, window, work / f"trl_{i}")

    runs = alternating_pairs(1 if ctx.quick else ctx.pairs, run_recipe, run_trl)
    t = vs_trl_table(runs, "SFTTrainer", "trained tokens", window)
    b = runs[-1][1]
    text = t.table + (
        f"\n\nModel: a tiny random Qwen2.5-VL (2 decoder layers of hidden 64, a 2-block tower, vocabulary 151,936: "
        f"bench/benchmarks/vlm/make_model.py), the vision tower frozen and its merger trained on both sides; "
        f"{RECORDS} chat records about coloured images of 16 to 32 pixels a side (tests/helpers/vision.py), "
        f"micro-batch {SETTINGS['train']['micro_batch_size']}, 2 ranks gloo, ddp. Both sides train the same tokens "
        f"per step: {t.same_tokens}. The recipe: fp32, train.loss_impl=chunked, rows padded per micro-batch. TRL "
        f"{b['trl']} SFTTrainer (assistant_only_loss=True, DataCollatorForVisionLanguageModeling): gradient "
        f"checkpointing {b['gradient_checkpointing']}, bf16={b['bf16']} (TRL turns both on by default), optimizer "
        f"{b['optim']}, attention {b['attn_implementation']}, {b['wrapper']}, in its own venv ({ctx.trl_venv_shown}). "
        f"{steps} steps, the first {warmup} left out; time from rank 0 at the end of each step. Peak memory: peak "
        "RSS of the process, max over ranks.")
    return {"title": "Image chat SFT vs TRL SFTTrainer (tiny Qwen2.5-VL, vocabulary 151,936)", "table": text,
            "ratios": [ratio("vlm: recipe / TRL SFTTrainer trained tokens/s", median(t.ratios), 2.0),
                       ratio("vlm: best window, recipe / TRL", median(t.best), 2.0),
                       ratio("vlm: recipe / TRL SFTTrainer peak memory per rank", median(t.mem), 1.0, "<=")],
            "raw": {"runs": runs, "ratios": t.ratios, "best_window_ratios": t.best, "memory_ratios": t.mem,
                    "steps": steps, "warmup": warmup}}
