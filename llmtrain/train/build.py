"""What every recipe builds before its first step, in order: preflight and the output_dir lock, the model
(meta -> LoRA -> plan -> parallelize -> weights or checkpoint), optimizer, checkpoint manager and state,
metrics logger; then its data steps; and the export at the end. Taking the whole Config (or a recipe's
subclass) is this package's job: it is the recipes' shared body, and hands each library call its section."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh

from llmtrain import checkpoint, data, distributed, lock, optim, parallelize, preflight
from llmtrain.models import attention, lora
from llmtrain.losses import token as loss_lib
from llmtrain.models import hf as model_lib
from llmtrain.config import Config, to_yaml
from llmtrain.metrics import MetricsLogger


@dataclass
class Run:
    """The built pieces a recipe's step, the loop and the export share."""
    cfg: Config
    env: distributed.DistEnv
    tokenizer: object
    model_config: object
    model: torch.nn.Module
    plan: parallelize.Plan
    mesh: DeviceMesh  # the policy's: a frozen copy (build_frozen) is sharded on the same one
    opt: torch.optim.Optimizer
    scaler: object
    peak_lr: float
    global_batch: int
    n_params: int
    n_trained: int  # parameters with gradients (fewer than n_params with LoRA)
    ckpt: checkpoint.CheckpointManager
    state: checkpoint.TrainState
    metrics: MetricsLogger
    token_loss: loss_lib.TokenLoss
    preemption: distributed.PreemptionFlag


def build_model(cfg: Config, env: distributed.DistEnv, tokenizer, model_config, resuming: bool):
    """Meta model -> LoRA -> plan -> parallelize -> each rank reads only its own slices of the weights
    (skipped when resuming a full fine-tune: the checkpoint holds every weight; LoRA's holds only adapters).
    Returns (model, plan, mesh, number of parameters, of trained ones, no-decay parameter names, LoRA's
    parameter line)."""
    model = model_lib.build_meta_model(model_config, cfg.model)
    # LoRA: on the meta model, so that every strategy wraps the adapters with their layer. adapters: their init.
    model, adapters = lora.prepare(model, cfg.lora, cfg.train.seed)
    n_params, params_line = sum(p.numel() for p in model.parameters()), lora.describe(model)
    no_decay = optim.no_decay_names(model)
    n_trained, frozen_bytes = parallelize.trained_and_frozen(model)
    plan = parallelize.resolve(cfg.parallel, n_trained, env.world_size, env.device, frozen_bytes)
    mesh = distributed.build_mesh(env, cfg.parallel.replicate)
    model = parallelize.parallelize(model, cfg.parallel, plan, mesh, env.device)
    if not resuming or cfg.lora.enabled:
        model_lib.load_weights(model, plan.strategy, cfg.model, model_config, cfg.train.seed, adapters)
    return model, plan, mesh, n_params, n_trained, no_decay, params_line


def build(cfg: Config, env: distributed.DistEnv) -> Run:
    """Everything up to the data, resumed from the newest verified checkpoint if there is one."""
    preemption = distributed.PreemptionFlag()
    if cfg.distributed.preflight:  # all ranks joined (distributed.init); now collectives, output_dir, versions
        summary = preflight.run(env, cfg.output_dir, cfg.distributed.preflight_timeout_s)
        if env.is_main:
            print(summary, flush=True)
    lock.hold(cfg.output_dir, env.rank)  # one run per output_dir: a second one exits 2, writing nothing
    tokenizer = model_lib.load_tokenizer(cfg.tokenizer.path or cfg.model.path, cfg.model.trust_remote_code)
    model_config = model_lib.load_model_config(cfg.model, tokenizer)
    model_lib.check_seq_len(model_config, cfg.data.seq_len)
    start = checkpoint.choose_resume(cfg.checkpoint, cfg.output_dir)  # verified; corrupt ones are skipped
    # LoRA: the frozen base's fingerprint, recorded in checkpoints and checked against the one resumed from.
    base = lora.fingerprint(cfg.model.path, cfg.model.config, cfg.train.seed) if cfg.lora.enabled else {}
    if start is not None:
        lora.check_resume(start, base)
    model, plan, mesh, n_params, n_trained, no_decay, params_line = build_model(cfg, env, tokenizer, model_config,
                                                                                 start is not None)
    model.train()
    distributed.seed_everything(cfg.train.seed + env.rank)  # per-rank dropout; the init above is shared

    peak = optim.peak_lr(cfg.train, env.world_size)
    opt = optim.build_optimizer(model, cfg.train, peak, no_decay)
    global_batch = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * env.world_size
    ckpt = checkpoint.CheckpointManager(cfg.checkpoint, cfg.output_dir, model, opt, env.rank, to_yaml(cfg),
                                        model_config, tokenizer)
    state = ckpt.resume(start) or checkpoint.TrainState(global_batch=global_batch, world_size=env.world_size,
                                                        base=base)
    model_lib.check_initialized(model)  # every parameter loaded (from model.path or the checkpoint)
    metrics = MetricsLogger(cfg.output_dir, env.is_main, cfg.train.max_steps, state.step, cfg.log.progress,
                            append=state.step > 0, section=cfg.log, run_config=cfg)
    metrics.info(f"model: {n_params / 1e6:.2f}M parameters | {env.world_size} x {env.device.type} "
                 f"({env.backend}) | strategy {plan.strategy.name} ({plan.reason}) | {cfg.parallel.mixed_precision}")
    _, attn_why = attention.choose(cfg.model.attn_implementation, model_config)
    metrics.info(f"{plan.strategy.describe(model)} | attention {attn_why}")
    if cfg.lora.enabled:
        metrics.info(f"lora: {params_line} | r={cfg.lora.r} alpha={cfg.lora.alpha:g} | base {cfg.lora.base_dtype}")
    token_loss = loss_lib.TokenLoss(cfg.train.loss_impl, model, env.device, cfg.train.loss_chunk_tokens)  # collective
    metrics.info(token_loss.describe())
    if state.step > 0:
        metrics.info(f"resumed at step {state.step} ({state.samples_seen} samples seen)")
    if env.is_main:
        (Path(cfg.output_dir) / "config.yaml").write_text(to_yaml(cfg))
    return Run(cfg, env, tokenizer, model_config, model, plan, mesh, opt, parallelize.grad_scaler(plan, env.device),
               peak, global_batch, n_params, n_trained, ckpt, state, metrics, token_loss, preemption)


def data_steps(run: Run, pairs: bool = False):
    """The data (one global order, whatever the world size or accumulation split; resumes at the saved
    position) -> (data.Built, the step iterator)."""
    cfg, env = run.cfg, run.env
    built = data.build(cfg.data, run.tokenizer, cfg.train.seed, env.is_main, env.rank, env.world_size)
    steps = data.make_steps(built, cfg.train.micro_batch_size, cfg.train.grad_accum_steps, env.world_size,
                            env.rank, cfg.train.seed, env.device, run.state.data)
    run.metrics.info(f"data: {built.stats.summary()} | global batch {run.global_batch} "
                     f"{'pairs' if pairs else 'rows'} of {cfg.data.seq_len} tokens")
    return built, steps


def export(run: Run, step_dir: str) -> list[Path]:
    """output_dir/hf[/step_dir]; with LoRA, as lora.export says, also output_dir/adapter[/step_dir]."""
    cfg, env = run.cfg, run.env
    dtype = parallelize.DTYPES[cfg.checkpoint.export_dtype]
    if cfg.lora.enabled:
        return lora.export(run.model, run.plan.strategy, env.device, Path(cfg.output_dir), step_dir, cfg.lora,
                           cfg.model.path, run.model_config, run.tokenizer, dtype, cfg.checkpoint.max_shard_size)
    out = Path(cfg.output_dir) / "hf" / step_dir
    checkpoint.export_hf(run.model, run.plan.strategy, env.device, out, run.model_config, run.tokenizer, dtype,
                         cfg.checkpoint.max_shard_size)
    return [out]


def build_frozen(run: Run) -> torch.nn.Module:
    """A frozen copy of model.path (e.g. DPO's reference), sharded on the policy's mesh where the policy is
    (fsdp, fsdp2: with FSDP2, every unit given back after each forward, Strategy.frozen), or whole on each rank
    where the policy is replicated (ddp: nothing to synchronise without gradients); no gradients, no optimizer
    state, in eval mode."""
    cfg, plan = run.cfg, run.plan
    model = model_lib.build_meta_model(run.model_config, cfg.model).requires_grad_(False)
    plan = dataclasses.replace(plan, strategy=plan.strategy.frozen())
    model = parallelize.parallelize(model, cfg.parallel, plan, run.mesh, run.env.device)
    model_lib.load_weights(model, plan.strategy, cfg.model, run.model_config, cfg.train.seed)
    model_lib.check_initialized(model)
    return model.eval()
