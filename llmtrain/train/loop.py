"""The training loop every recipe shares, parameterized by the recipe's batch source and objective (one
accumulation per step, llmtrain.train.step): step timing, the
lr schedule, train.on_nan, logging and throughput, the eval hook, checkpoints (due, timer, preemption),
periodic and final exports."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from llmtrain import distributed, optim
from llmtrain import metrics as metrics_lib
from llmtrain.metrics import Throughput
from llmtrain.train.build import Run, export
from llmtrain.train.harness import Harness
from llmtrain.train.source import BatchSource
from llmtrain.train.step import Objective, accumulate


class Preempted(Exception):
    """Saved after SIGTERM/SIGUSR1; exit with the requeue code."""


def loop(run: Run, source: BatchSource, objective: Objective, evaluate: Callable[[int], dict] | None = None,
         final_export: bool = True) -> torch.nn.Module:
    """Train from run.state.step to train.max_steps; `evaluate(step)` (its metrics are logged) at
    eval.every_steps. Returns the model."""
    cfg, env, state, metrics, ckpt = run.cfg, run.env, run.state, run.metrics, run.ckpt
    # Throughput, MFU, step time and memory over the steps between two logged steps (metrics.py).
    policy = run.policy
    n_trained = policy.n_trained if cfg.lora.enabled else None  # LoRA: weight gradients for the adapters only
    perf = Throughput(metrics_lib.model_flops_per_token(policy.config, policy.n_params, cfg.data.seq_len, n_trained),
                      env.world_size, env.device, run.tokenizer.pad_token_id,
                      *metrics_lib.device_peak_tflops(env.device, cfg.parallel.mixed_precision, cfg.log.peak_tflops))
    metrics.info(perf.describe())
    if note := optim.warmup_note(cfg.train):
        metrics.info(note)
    harness = Harness(cfg.eval.harness, cfg.lora)
    preemption = run.preemption  # what a preemption signal's line says (distributed.PreemptionFlag)
    preemption.saved_step = state.step if state.step else None  # resumed from that checkpoint
    while state.step < cfg.train.max_steps:
        preemption.step = state.step
        t0 = time.perf_counter()
        batch = source.next()
        data_wait = time.perf_counter() - t0 - batch.work_s
        lr = optim.lr_at(state.step, cfg.train, run.peak_lr)
        optim.set_lr(run.opt, lr)
        result = accumulate(run.stepper, batch.micro, objective, (cfg.train.seed, state.step))
        if not result.ok and cfg.train.on_nan == "stop":
            raise FloatingPointError(f"non-finite loss ({result.loss}) or grad norm ({result.grad_norm}) at step "
                                     f"{state.step + 1}; stopped without saving this state "
                                     "(train.on_nan=skip skips such steps)")
        state.step += 1
        state.samples_seen += run.global_batch
        state.tokens_seen += result.n_tokens
        state.skipped_steps += not result.ok
        state.data = source.position()
        preemption.step_s = time.perf_counter() - t0
        perf.add(batch.micro, preemption.step_s - data_wait)
        metrics.step(result.loss, perf.last_tokens_per_sec)
        last = state.step == cfg.train.max_steps
        if state.step % cfg.log.every_steps == 0 or last:
            metrics.log({"step": state.step, "loss": result.loss, **batch.metrics, **result.extra, "lr": lr,
                         "grad_norm": result.grad_norm, "trained_tokens": result.n_tokens,
                         "skipped_steps": state.skipped_steps, "data_wait_s": data_wait,
                         "elapsed_s": metrics.elapsed(),
                         **perf.collect()})  # collect() is a collective: every rank logs the same steps
        if evaluate and cfg.eval.every_steps and (state.step % cfg.eval.every_steps == 0 or last):
            if record := evaluate(state.step):
                metrics.log({"step": state.step, **record})
        if harness.due(state.step, last):
            metrics.log({"step": state.step, **harness.score_current(run)})
        ckpt.poll()
        preempted, timer = distributed.any_rank(run.preemption.signal is not None, ckpt.timer_fired(),
                                                device=env.device)
        if ckpt.due(state.step, timer) or preempted or (last and cfg.checkpoint.every_steps > 0):
            ckpt.save(state)
            preemption.saved_step = state.step
        if cfg.checkpoint.export_every_steps and state.step % cfg.checkpoint.export_every_steps == 0:
            export(run, f"step_{state.step}")
        if preempted:
            ckpt.wait()
            metrics.info(f"preempted: checkpoint step_{state.step} saved; exiting with code "
                         f"{distributed.PREEMPTED_EXIT_CODE} to be requeued")
            metrics.close()
            raise Preempted()

    ckpt.wait()
    if final_export:
        out = export(run, "")
        metrics.info(f"exported {' and '.join(map(str, out))}")
    if harness.at_end():
        hf = Path(cfg.output_dir) / "hf"
        scores = harness.score_export(run, hf) if final_export and hf in out else harness.score_current(run)
        metrics.log({"step": state.step, **scores})
    metrics.close()
    return run.model
