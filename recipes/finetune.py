#!/usr/bin/env python
"""Fine-tune a Llama-style causal LM with DDP, FSDP (FSDP1) or FSDP2, on GPUs (NCCL) or CPU (gloo).

    torchrun --nproc_per_node=N recipes/finetune.py --config configs/demo.yaml [key.sub=value ...]
    python recipes/finetune.py --config configs/demo.yaml           # one process, same code path
    python recipes/finetune.py --help-config                        # every key, type, default

Reads top to bottom: config -> distributed -> model -> parallelize -> data -> optim -> train -> export.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout, installed or not

import torch  # noqa: E402

from llmtrain import checkpoint, data, distributed, model as model_lib, optim, parallelize  # noqa: E402
from llmtrain.config import Config, ConfigError, describe, load_config, to_yaml  # noqa: E402
from llmtrain.loss import token_loss_sum, trained_tokens  # noqa: E402
from llmtrain.metrics import MetricsLogger  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Fine-tune a Llama-style model (DDP / FSDP / FSDP2; CUDA+NCCL or CPU+gloo).",
        epilog="Overrides: dotted keys, e.g. train.lr=1e-4 parallel.strategy=fsdp2 (see --help-config).")
    p.add_argument("--config", help="YAML config file (configs/*.yaml)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--help-config", action="store_true", help="list every config key and exit")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    return p.parse_args(argv)


def setup(args: argparse.Namespace) -> Config:
    """Everything that can be checked without a process group or a model: bad input fails here."""
    cfg = load_config(args.config, args.overrides)
    model_lib.check_paths(cfg.model, cfg.tokenizer.path)
    data.resolve_files(cfg.data.path)
    device, _ = distributed.pick_device(cfg.distributed, distributed.local_rank_from_env())
    parallelize.check(cfg.parallel, distributed.world_size_from_env(), device.type)
    return cfg


def train_step(model, plan, batches, opt, scaler, cfg: Config, env: distributed.DistEnv) -> tuple[float, float, int]:
    """One optimizer step over grad_accum_steps micro-batches; returns (global loss, grad norm, tokens)."""
    local = torch.stack([trained_tokens(b["labels"]) for b in batches]).sum()
    n_tokens = int(distributed.all_reduce(local.to(env.device)).item())
    # Data-parallel wrappers average gradients over ranks; scaling by world/n makes the result the
    # gradient of (sum of all token losses) / (global trained tokens).
    scale = env.world_size / max(n_tokens, 1)
    loss_sum = torch.zeros((), device=env.device)
    for i, batch in enumerate(batches):
        batch = {k: v.to(env.device, non_blocking=True) for k, v in batch.items()}
        with parallelize.grad_sync(model, plan, enabled=i == len(batches) - 1):
            with parallelize.autocast(plan, env.device):
                logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            loss = token_loss_sum(logits, batch["labels"])
            scaled = loss * scale
            (scaler.scale(scaled) if scaler else scaled).backward()
        loss_sum += loss.detach()
    if scaler:
        scaler.unscale_(opt)
    grad_norm = parallelize.clip_grad_norm(model, plan, cfg.train.max_grad_norm)
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)
    loss = distributed.all_reduce(loss_sum).item() / max(n_tokens, 1)
    return loss, float(grad_norm), n_tokens


def train(cfg: Config, env: distributed.DistEnv) -> torch.nn.Module:
    """Train and export; returns the trained (wrapped) model."""
    metrics = MetricsLogger(cfg.output_dir, env.is_main, cfg.train.max_steps, 0, cfg.log.progress)
    if env.is_main:
        (Path(cfg.output_dir) / "config.yaml").write_text(to_yaml(cfg))

    # Model: built on meta, sharded/wrapped, then weights arrive from rank 0 (host RAM: one copy).
    tokenizer = model_lib.load_tokenizer(cfg.tokenizer.path or cfg.model.path, cfg.model.trust_remote_code)
    model_config = model_lib.load_model_config(cfg.model, tokenizer)
    model = model_lib.build_meta_model(model_config, cfg.model)
    n_params = sum(p.numel() for p in model.parameters())
    plan = parallelize.resolve(cfg.parallel, n_params, env.world_size, env.device)
    metrics.info(f"model: {n_params / 1e6:.2f}M parameters | {env.world_size} x {env.device.type} "
                 f"({env.backend}) | strategy {plan.strategy} ({plan.reason}) | {cfg.parallel.mixed_precision}")
    mesh = distributed.build_mesh(env, cfg.parallel.replicate)
    model = parallelize.parallelize(model, cfg.parallel, plan, mesh, env.device)
    model_lib.load_weights(model, model_lib.full_state_dict_rank0(cfg.model, model_config, cfg.train.seed),
                           env.device)
    model.train()
    distributed.seed_everything(cfg.train.seed + env.rank)  # per-rank dropout; the init above is shared

    # Data: one global order, whatever the world size or accumulation split.
    dataset = data.build_dataset(cfg.data, tokenizer, env.is_main)
    steps = data.step_batches(dataset, cfg.train.micro_batch_size, cfg.train.grad_accum_steps,
                              env.world_size, env.rank, cfg.train.seed)
    global_batch = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * env.world_size
    metrics.info(f"data: {len(dataset)} rows x {cfg.data.seq_len} tokens | global batch {global_batch} rows | "
                 f"{len(dataset) // global_batch} steps per epoch")

    peak = optim.peak_lr(cfg.train, env.world_size)
    opt = optim.build_optimizer(model, cfg.train, peak, env.device)
    scaler = parallelize.grad_scaler(plan, env.device)

    window_tokens, window_start = 0, time.perf_counter()
    for step in range(cfg.train.max_steps):
        t0 = time.perf_counter()
        batches = next(steps)
        data_wait = time.perf_counter() - t0
        lr = optim.lr_at(step, cfg.train, peak)
        optim.set_lr(opt, lr)
        loss, grad_norm, n_tokens = train_step(model, plan, batches, opt, scaler, cfg, env)
        window_tokens += global_batch * cfg.data.seq_len
        metrics.step(loss)
        done = step + 1
        if done % cfg.log.every_steps == 0 or done == cfg.train.max_steps:
            now = time.perf_counter()
            metrics.log({"step": done, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                         "tokens_per_sec": window_tokens / (now - window_start), "trained_tokens": n_tokens,
                         "data_wait_s": data_wait, "elapsed_s": metrics.elapsed()})
            window_tokens, window_start = 0, now

    out = Path(cfg.output_dir) / "hf"
    checkpoint.export_hf(model, plan.strategy, env.device, out, model_config, tokenizer)
    metrics.info(f"exported Hugging Face model to {out}")
    metrics.close()
    return model


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
    env = distributed.init(cfg.distributed)
    try:
        train(cfg, env)
        return 0
    except ConfigError as e:
        print(f"error (rank {env.rank}): {e}", file=sys.stderr)
        return 2
    except Exception:
        traceback.print_exc()
        print(f"error (rank {env.rank}): training failed; see the traceback above", file=sys.stderr)
        return 1
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    distributed.hard_exit(main())
