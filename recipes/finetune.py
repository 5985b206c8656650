#!/usr/bin/env python
"""Fine-tune a Llama-style causal LM with DDP, FSDP (FSDP1) or FSDP2, on GPUs (NCCL) or CPU (gloo).

    torchrun --nproc_per_node=N recipes/finetune.py --config configs/demo.yaml [key.sub=value ...]
    python recipes/finetune.py --config configs/demo.yaml           # one process, same code path
    python recipes/finetune.py --help-config                        # every key, type, default

Reads top to bottom: config -> distributed -> model -> parallelize -> data -> optim -> train -> export.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout, installed or not

import torch  # noqa: E402

from llmtrain import checkpoint, data, distributed, model as model_lib, optim, parallelize  # noqa: E402
from llmtrain.config import Config, ConfigError, describe, load_config, to_yaml  # noqa: E402
from llmtrain import attention, launch, lock, lora, preflight  # noqa: E402
from llmtrain import loss as loss_lib  # noqa: E402
from llmtrain.step import train_step  # noqa: E402
from llmtrain import metrics as metrics_lib  # noqa: E402
from llmtrain.metrics import MetricsLogger, Throughput  # noqa: E402


USAGE = """\
Fine-tune a Llama-style causal LM with DDP, FSDP or FSDP2 on GPUs (NCCL) or CPUs (gloo).

  torchrun --nproc_per_node=N recipes/finetune.py --config configs/demo.yaml [key.sub=value ...]
  python recipes/finetune.py --config configs/demo.yaml parallel.strategy=none   # one process

Settings come from the YAML file, then from dotted overrides (train.lr=1e-4 log.tensorboard=true);
--help-config lists every key. configs/ holds ready-made files for common jobs.

Writes to output_dir: metrics.jsonl (one record per logged step), config.yaml, checkpoints/
(checkpoint.every_steps; a rerun resumes), hf/ (the Hugging Face export), tensorboard/, wandb/.
Then: python -m llmtrain.plot OUTPUT_DIR          loss / lr / throughput curves as a PNG
      python -m llmtrain.generate --model OUTPUT_DIR/hf --prompt "..." [--chat]
      python -m llmtrain.convert OUTPUT_DIR/checkpoints/step_N OUT    checkpoint -> HF export
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Overrides: dotted keys, e.g. train.lr=1e-4 parallel.strategy=fsdp2 "
                                       "(see --help-config).")
    p.add_argument("--config", help="YAML config file (configs/*.yaml)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--help-config", action="store_true", help="list every config key and exit")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    return p.parse_args(argv)


def setup(args: argparse.Namespace) -> Config:
    """Everything that can be checked without a process group or a model: bad input fails here."""
    cfg = load_config(args.config, args.overrides)
    # Under `accelerate launch`: every setting it asks for must be what parallel.* gives (parallel.* governs).
    for line in launch.check_accelerate(cfg.parallel, os.environ):
        if os.environ.get("RANK", "0") == "0" and not args.print_config:
            print(line, flush=True)
    model_lib.check_paths(cfg.model, cfg.tokenizer.path)
    data.check(cfg.data)
    device, _ = distributed.pick_device(cfg.distributed, distributed.local_rank_from_env())
    parallelize.check(cfg.parallel, distributed.world_size_from_env(), device.type)
    checkpoint.check_writable(cfg.output_dir)
    resume = checkpoint.resume_path(cfg.checkpoint, cfg.output_dir)
    lora.check(cfg.lora, resume, cfg.model.path, cfg.model.config, cfg.train.seed)
    metrics_lib.check(cfg.log)
    loss_lib.check(cfg.train.loss_impl, device.type)
    return cfg


def train(cfg: Config, env: distributed.DistEnv) -> torch.nn.Module:
    """Train (resuming if asked) and export; returns the trained (wrapped) model."""
    preemption = distributed.PreemptionFlag()
    if cfg.distributed.preflight:  # all ranks joined (distributed.init); now collectives, output_dir, versions
        summary = preflight.run(env, cfg.output_dir, cfg.distributed.preflight_timeout_s)
        if env.is_main:
            print(summary, flush=True)
    lock.hold(cfg.output_dir, env.rank)  # one run per output_dir: a second one exits 2, writing nothing
    # Model: built on meta, sharded/wrapped, then each rank reads only its own slices of the weights.
    tokenizer = model_lib.load_tokenizer(cfg.tokenizer.path or cfg.model.path, cfg.model.trust_remote_code)
    model_config = model_lib.load_model_config(cfg.model, tokenizer)
    model_lib.check_seq_len(model_config, cfg.data.seq_len)
    model = model_lib.build_meta_model(model_config, cfg.model)
    # LoRA: on the meta model, so that every strategy wraps the adapters with their layer. adapters: their init.
    model, adapters = lora.prepare(model, cfg.lora, cfg.train.seed)
    n_params, params_line = sum(p.numel() for p in model.parameters()), lora.describe(model)
    no_decay = optim.no_decay_names(model)
    n_trained, frozen_bytes = parallelize.trained_and_frozen(model)
    plan = parallelize.resolve(cfg.parallel, n_trained, env.world_size, env.device, frozen_bytes)
    mesh = distributed.build_mesh(env, cfg.parallel.replicate)
    model = parallelize.parallelize(model, cfg.parallel, plan, mesh, env.device)
    start = checkpoint.choose_resume(cfg.checkpoint, cfg.output_dir)  # verified; corrupt ones are skipped
    if start is None or cfg.lora.enabled:  # else the checkpoint holds every weight (LoRA's: the adapters only)
        model_lib.load_weights(model, cfg.model, model_config, cfg.train.seed, adapters)
    model.train()
    distributed.seed_everything(cfg.train.seed + env.rank)  # per-rank dropout; the init above is shared

    peak = optim.peak_lr(cfg.train, env.world_size)
    opt = optim.build_optimizer(model, cfg.train, peak, no_decay)
    scaler = parallelize.grad_scaler(plan, env.device)
    global_batch = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * env.world_size
    ckpt = checkpoint.CheckpointManager(cfg.checkpoint, cfg.output_dir, model, opt, env.rank, to_yaml(cfg),
                                        model_config, tokenizer)
    state = ckpt.resume(start) or checkpoint.TrainState(global_batch=global_batch, world_size=env.world_size,
                                                        base=lora.fingerprint(cfg.model.path, cfg.model.config,
                                                                              cfg.train.seed) if cfg.lora.enabled else {})
    model_lib.check_initialized(model)  # every parameter loaded (from model.path or the checkpoint)
    metrics = MetricsLogger(cfg.output_dir, env.is_main, cfg.train.max_steps, state.step, cfg.log.progress,
                            append=state.step > 0, section=cfg.log, run_config=cfg)
    metrics.info(f"model: {n_params / 1e6:.2f}M parameters | {env.world_size} x {env.device.type} "
                 f"({env.backend}) | strategy {plan.strategy} ({plan.reason}) | {cfg.parallel.mixed_precision}")
    _, attn_why = attention.choose(cfg.model.attn_implementation, model_config)
    metrics.info(f"{parallelize.describe(model, plan)} | attention {attn_why}")
    if cfg.lora.enabled:
        metrics.info(f"lora: {params_line} | r={cfg.lora.r} alpha={cfg.lora.alpha:g} | base {cfg.lora.base_dtype}")
    token_loss = loss_lib.TokenLoss(cfg.train.loss_impl, model, env.device, cfg.train.loss_chunk_tokens)  # collective
    metrics.info(token_loss.describe())
    if state.step > 0:
        metrics.info(f"resumed at step {state.step} ({state.samples_seen} samples seen)")
    if env.is_main:
        (Path(cfg.output_dir) / "config.yaml").write_text(to_yaml(cfg))

    # Data: one global order, whatever the world size or accumulation split; the position is saved.
    built = data.build(cfg.data, tokenizer, cfg.train.seed, env.is_main, env.rank, env.world_size)
    steps = data.make_steps(built, cfg.train.micro_batch_size, cfg.train.grad_accum_steps, env.world_size,
                            env.rank, cfg.train.seed, env.device, state.data)
    metrics.info(f"data: {built.stats.summary()} | global batch {global_batch} rows of {cfg.data.seq_len} tokens")

    # Throughput, MFU, step time and memory over the steps between two logged steps (metrics.py).
    perf = Throughput(metrics_lib.model_flops_per_token(model_config, n_params, cfg.data.seq_len), env.world_size,
                      env.device, tokenizer.pad_token_id,
                      *metrics_lib.device_peak_tflops(env.device, cfg.parallel.mixed_precision, cfg.log.peak_tflops))
    metrics.info(perf.describe())
    while state.step < cfg.train.max_steps:
        t0 = time.perf_counter()
        batches = next(steps)
        data_wait = time.perf_counter() - t0
        lr = optim.lr_at(state.step, cfg.train, peak)
        optim.set_lr(opt, lr)
        loss, grad_norm, n_tokens, ok = train_step(model, plan, batches, opt, scaler, cfg.train.max_grad_norm,
                                                   env.device, env.world_size, token_loss)
        if not ok and cfg.train.on_nan == "stop":
            raise FloatingPointError(f"non-finite loss ({loss}) or grad norm ({grad_norm}) at step {state.step + 1}; "
                                     "stopped without saving this state (train.on_nan=skip skips such steps)")
        state.step += 1
        state.samples_seen += global_batch
        state.tokens_seen += n_tokens
        state.skipped_steps += not ok
        state.data = steps.position()
        perf.add(batches, time.perf_counter() - t0 - data_wait)
        metrics.step(loss, perf.last_tokens_per_sec)
        if state.step % cfg.log.every_steps == 0 or state.step == cfg.train.max_steps:
            metrics.log({"step": state.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "trained_tokens": n_tokens,
                         "skipped_steps": state.skipped_steps, "data_wait_s": data_wait, "elapsed_s": metrics.elapsed(),
                         **perf.collect()})  # collect() is a collective: every rank logs the same steps
        if cfg.eval.every_steps and (state.step % cfg.eval.every_steps == 0 or state.step == cfg.train.max_steps):
            evaluate(model, plan, built.val, cfg, env, state.step, metrics, token_loss)
        ckpt.poll()
        preempted, timer = distributed.any_rank(preemption.signal is not None, ckpt.timer_fired(), device=env.device)
        last = state.step == cfg.train.max_steps
        if ckpt.due(state.step, timer) or preempted or (last and cfg.checkpoint.every_steps > 0):
            ckpt.save(state)
        if cfg.checkpoint.export_every_steps and state.step % cfg.checkpoint.export_every_steps == 0:
            export(model, plan, env, cfg, model_config, tokenizer, f"step_{state.step}")
        if preempted:
            ckpt.wait()
            metrics.info(f"preempted: checkpoint step_{state.step} saved; exiting with code "
                         f"{distributed.PREEMPTED_EXIT_CODE} to be requeued")
            metrics.close()
            raise Preempted()

    ckpt.wait()
    out = export(model, plan, env, cfg, model_config, tokenizer, "")
    metrics.info(f"exported {' and '.join(map(str, out))}")
    metrics.close()
    return model


def evaluate(model, plan, val, cfg: Config, env: distributed.DistEnv, step: int, metrics: MetricsLogger,
             token_loss: loss_lib.TokenLoss) -> None:
    batches = data.eval_batches(val, cfg.train.micro_batch_size, env.world_size, env.rank, cfg.eval.max_batches)
    val_loss, _ = loss_lib.evaluate(model, batches, env.device, lambda: parallelize.autocast(plan, env.device),
                                    token_loss)
    metrics.log({"step": step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))})


def export(model, plan, env, cfg: Config, model_config, tokenizer, step_dir: str) -> list[Path]:
    """output_dir/hf[/step_dir]; with LoRA, as lora.export says, also output_dir/adapter[/step_dir]."""
    dtype = parallelize.DTYPES[cfg.checkpoint.export_dtype]
    if cfg.lora.enabled:
        return lora.export(model, plan.strategy, env.device, Path(cfg.output_dir), step_dir, cfg.lora, cfg.model.path,
                           model_config, tokenizer, dtype, cfg.checkpoint.max_shard_size)
    out = Path(cfg.output_dir) / "hf" / step_dir
    checkpoint.export_hf(model, plan.strategy, env.device, out, model_config, tokenizer, dtype,
                         cfg.checkpoint.max_shard_size)
    return [out]


class Preempted(Exception):
    """Saved after SIGTERM/SIGUSR1; exit with the requeue code."""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.help_config:
        for key, tp, default, doc in describe():
            print(f"{key:36} {tp:48} {default:14} {doc}")
        return 0
    try:
        cfg = setup(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    try:
        env = distributed.init(cfg.distributed)
    except distributed.PreflightError as e:  # a rank missing or unreachable, named, within the preflight timeout
        print(f"error: preflight failed: {e}", file=sys.stderr)
        return 1
    try:
        train(cfg, env)
        return 0
    except Preempted:
        return distributed.PREEMPTED_EXIT_CODE
    except (ConfigError, FloatingPointError, checkpoint.SaveError, distributed.PreflightError) as e:
        print(f"error (rank {env.rank}): {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    except Exception:
        traceback.print_exc()
        print(f"error (rank {env.rank}): training failed; see the traceback above", file=sys.stderr)
        return 1
    finally:
        lock.release()
        distributed.shutdown()


if __name__ == "__main__":
    distributed.hard_exit(main())
