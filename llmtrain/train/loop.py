"""The training loop every recipe shares, parameterized by the recipe's batch source and objective (one
accumulation per step, llmtrain.train.step): step timing, the
lr schedule, train.on_nan, logging and throughput, the eval hook, checkpoints (due, timer, preemption),
periodic and final exports."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from llmtrain import distributed, optim
from llmtrain import metrics as metrics_lib
from llmtrain.metrics import Throughput
from llmtrain.train.build import Run, export
from llmtrain.train.harness import Harness
from llmtrain.train.source import Batch, BatchSource
from llmtrain.train.step import Objective, StepResult, accumulate


class Preempted(Exception):
    """Saved after SIGTERM/SIGUSR1; exit with the requeue code."""


class Step(NamedTuple):
    """One trained step: its micro-batches' result, the lr it ran at and the seconds spent waiting for data."""
    batch: Batch
    result: StepResult
    lr: float
    data_wait: float


def loop(run: Run, source: BatchSource, objective: Objective, evaluate: Callable[[int], dict] | None = None,
         final_export: bool = True) -> torch.nn.Module:
    """Train from run.state.step to train.max_steps; `evaluate(step)` (its metrics are logged) at
    eval.every_steps. Returns the model."""
    cfg, state = run.cfg, run.state
    perf = throughput(run)
    run.metrics.info(perf.describe())
    if note := optim.warmup_note(cfg.train):
        run.metrics.info(note)
    harness = Harness(cfg.eval.harness, cfg.lora)
    run.preemption.saved_step = state.step if state.step else None  # resumed from that checkpoint
    while state.step < cfg.train.max_steps:
        step = train_step(run, source, objective, perf)
        last = state.step == cfg.train.max_steps
        log_step(run, step, perf, last)
        if evaluate and cfg.eval.every_steps and (state.step % cfg.eval.every_steps == 0 or last):
            if record := evaluate(state.step):
                run.metrics.log({"step": state.step, **record})
        if harness.due(state.step, last):
            run.metrics.log({"step": state.step, **harness.score_current(run)})
        save_when_due(run, last)
    finish(run, harness, final_export)
    return run.model


def throughput(run: Run) -> Throughput:
    """Throughput, MFU, step time and memory over the steps between two logged steps (metrics.py)."""
    cfg, env, policy = run.cfg, run.env, run.policy
    n_trained = policy.n_trained if cfg.lora.enabled else None  # LoRA: weight gradients for the adapters only
    return Throughput(metrics_lib.model_flops_per_token(policy.config, policy.n_params, cfg.data.seq_len, n_trained),
                      env.world_size, env.device, run.tokenizer.pad_token_id,
                      *metrics_lib.device_peak_tflops(env.device, cfg.parallel.mixed_precision, cfg.log.peak_tflops),
                      sp_size=env.sp_size)


def train_step(run: Run, source: BatchSource, objective: Objective, perf: Throughput) -> Step:
    """The next batch trained at the schedule's lr (train.on_nan=stop raises before it counts), the run's state
    advanced and the step timed (what a preemption signal's line says: distributed.PreemptionFlag)."""
    cfg, state, preemption = run.cfg, run.state, run.preemption
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
    run.metrics.step(result.loss, perf.last_tokens_per_sec)
    return Step(batch, result, lr, data_wait)


def log_step(run: Run, step: Step, perf: Throughput, last: bool) -> None:
    """The step's record every log.every_steps and at the last step."""
    state, metrics, result = run.state, run.metrics, step.result
    if state.step % run.cfg.log.every_steps == 0 or last:
        metrics.log({"step": state.step, "loss": result.loss, **step.batch.metrics, **result.extra, "lr": step.lr,
                     "grad_norm": result.grad_norm, "trained_tokens": result.n_tokens,
                     "skipped_steps": state.skipped_steps, "data_wait_s": step.data_wait,
                     "elapsed_s": metrics.elapsed(),
                     **perf.collect()})  # collect() is a collective: every rank logs the same steps


def save_when_due(run: Run, last: bool) -> None:
    """A checkpoint when due (checkpoint.every_steps, its timer, a preemption signal on any rank, the last step),
    an export every checkpoint.export_every_steps; after a preemption's save, raises Preempted."""
    cfg, state, ckpt, metrics = run.cfg, run.state, run.ckpt, run.metrics
    ckpt.poll()
    preempted, timer = distributed.any_rank(run.preemption.signal is not None, ckpt.timer_fired(),
                                            device=run.env.device)
    if ckpt.due(state.step, timer) or preempted or (last and cfg.checkpoint.every_steps > 0):
        ckpt.save(state)
        run.preemption.saved_step = state.step
    if cfg.checkpoint.export_every_steps and state.step % cfg.checkpoint.export_every_steps == 0:
        export(run, f"step_{state.step}")
    if preempted:
        ckpt.wait()
        metrics.info(f"preempted: checkpoint step_{state.step} saved; exiting with code "
                     f"{distributed.PREEMPTED_EXIT_CODE} to be requeued")
        metrics.close()
        raise Preempted()


def finish(run: Run, harness: Harness, final_export: bool) -> None:
    """After the last step: the pending save, the final export and the harness's scores at the end."""
    cfg, metrics = run.cfg, run.metrics
    run.ckpt.wait()
    if final_export:
        out = export(run, "")
        metrics.info(f"exported {' and '.join(map(str, out))}")
    if harness.at_end():
        hf = Path(cfg.output_dir) / "hf"
        scores = harness.score_export(run, hf) if final_export and hf in out else harness.score_current(run)
        metrics.log({"step": run.state.step, **scores})
    metrics.close()
