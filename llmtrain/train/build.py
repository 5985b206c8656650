"""What every recipe builds before its first step, in order: preflight and the output_dir lock, the policy
(models.build.build_model), optimizer, checkpoint manager with every registered state, resume, metrics logger;
then its data and the data's batch source; and the export at the end. A model beside the policy (a reference, a
teacher) is llmtrain.train.frozen's.
Taking the whole Config (or a recipe's subclass) is this package's job: it is the recipes' shared body, and
hands each library call its section."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from llmtrain import checkpoint, data, distributed, export as export_lib, optim, parallelize
from llmtrain.config import CheckpointConfig, Config, ConfigError, to_yaml
from llmtrain.losses import token as loss_lib
from llmtrain.metrics import METRICS_FILE, MetricsLogger
from llmtrain.data import vision as vision_data
from llmtrain.models import attention, lora, offload
from llmtrain.models import hf as model_lib
from llmtrain.models.build import BuiltModel, build_model
from llmtrain.run import lock, preflight, resume
from llmtrain.train.source import DataSource
from llmtrain.train.step import Stepper
from llmtrain.utils import DTYPES


class Registered(NamedTuple):
    """A recipe's own state for the checkpoints (CheckpointManager.register)."""
    name: str
    obj: checkpoint.Stateful
    per_rank: bool = False


@dataclass
class Run:
    """The built pieces a recipe's step, the loop and the export share."""
    cfg: Config
    env: distributed.DistEnv
    tokenizer: object
    policy: BuiltModel
    opt: torch.optim.Optimizer
    scaler: object
    peak_lr: float
    global_batch: int
    ckpt: checkpoint.CheckpointManager
    state: checkpoint.TrainState
    metrics: MetricsLogger
    token_loss: loss_lib.TokenLoss | None  # None for a score head (Recipe.score_head)
    preemption: distributed.PreemptionFlag
    processor: object | None = None  # a vision-language model's (data/vision.py); its tokenizer is `tokenizer`
    saved: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext  # models.offload.for_run's

    @property
    def model(self) -> torch.nn.Module:
        return self.policy.model

    @property
    def plan(self) -> parallelize.Plan:
        return self.policy.plan

    @property
    def model_config(self):
        return self.policy.config

    @property
    def stepper(self) -> Stepper:
        return Stepper(self.model, self.plan, self.opt, self.scaler, self.cfg.train.max_grad_norm, self.env.device,
                       self.env.world_size, self.env.sp_group, self.saved)

    def autocast(self) -> contextlib.AbstractContextManager:
        return parallelize.autocast(self.plan, self.env.device)


def build(cfg: Config, env: distributed.DistEnv, recipe: str, registered: list[Registered] = (),
          score_head: bool = False) -> Run:
    """Everything up to the data, resumed from the newest verified checkpoint if there is one (with every
    `registered` object's state) when it was saved by the same setup (llmtrain.run.resume). score_head: the policy
    is model.path's body with a one-score head (a reward model, models.hf.as_score_model)."""
    preemption = distributed.PreemptionFlag()
    if cfg.distributed.preflight:  # all ranks joined (distributed.init); now collectives, output_dir, versions
        summary = preflight.run(env, cfg.output_dir, cfg.distributed.preflight_timeout_s)
        if env.is_main:
            print(summary, flush=True)
    lock.hold(cfg.output_dir, env.rank)  # one run per output_dir: a second one exits 2, writing nothing
    processor = vision_data.processor_for(cfg.model, data.chat_template(cfg.data))
    tokenizer = processor.tokenizer if processor else \
        model_lib.load_tokenizer(cfg.tokenizer.path or cfg.model.path, cfg.model.trust_remote_code)
    model_config = model_lib.load_model_config(cfg.model, tokenizer)
    if score_head:
        model_config = model_lib.as_score_model(model_config, tokenizer)
    model_lib.check_seq_len(model_config, cfg.data.seq_len)
    point = _resume_point(cfg, recipe, model_config, env.dp_size)
    # Resuming: the checkpoint holds every trained weight (LoRA's: the adapters; the base is loaded here).
    policy = build_model(cfg.model, model_config, cfg.parallel, env, cfg.train.seed, cfg.lora,
                         load=point.start is None)
    model = policy.model
    model.train()
    distributed.seed_everything(cfg.train.seed + env.rank)  # per rank; LoRA dropout is keyed (models/dropout.py)

    peak = optim.peak_lr(cfg.train, env.dp_size)
    opt = optim.build_optimizer(model, cfg.train, peak, policy.no_decay)
    global_batch = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * env.dp_size
    ckpt = checkpoint.CheckpointManager(cfg.checkpoint, cfg.output_dir, model, opt, env.rank, to_yaml(cfg),
                                        model_config, tokenizer)
    for r in registered:
        ckpt.register(r.name, r.obj, r.per_rank)
    state = ckpt.resume(point.start) or checkpoint.TrainState(global_batch=global_batch, world_size=env.world_size,
                                                              base=point.base)
    # What the next checkpoints record: this run's (also after an allowed change).
    state.identity, state.global_batch, state.world_size = point.identity, global_batch, env.world_size
    model_lib.check_initialized(model)  # every parameter loaded (from model.path or the checkpoint)
    replaced = [] if state.step > 0 else _earlier_run(cfg.output_dir)  # before the logger truncates its file
    metrics = MetricsLogger(cfg.output_dir, env.is_main, cfg.train.max_steps, state.step, cfg.log.progress,
                            append=state.step > 0, section=cfg.log, run_config=cfg)
    token_loss = None  # a score head has no token logits
    if not score_head:
        token_loss = loss_lib.TokenLoss(cfg.train.loss_impl, model, env.device,
                                        cfg.train.loss_chunk_tokens, env.sp_group)  # collective
    _describe(metrics, cfg, env, policy, model_config, token_loss, processor)
    if state.step > 0:
        metrics.info(f"resumed at step {state.step} ({state.samples_seen} samples seen)")
    for line in point.changed:
        metrics.info(line)
    if replaced:
        metrics.info(f"note: output_dir {cfg.output_dir} holds an earlier run's {' and '.join(replaced)} and no "
                     "checkpoint to resume from: this run starts over and replaces them (another output_dir keeps "
                     "them)")
    saved, line = offload.for_run(cfg.train.activation_offloading, env.device)
    if line:
        metrics.info(line)
    if env.is_main:
        (Path(cfg.output_dir) / "config.yaml").write_text(to_yaml(cfg))
    return Run(cfg, env, tokenizer, policy, opt, parallelize.grad_scaler(policy.plan, env.device), peak, global_batch,
               ckpt, state, metrics, token_loss, preemption, processor, saved)


class ResumePoint(NamedTuple):
    """Where a run starts: the newest verified checkpoint of output_dir (None: from model.path) and what it is."""
    start: Path | None
    changed: list[str]  # a line per allowed change of setup since that checkpoint was saved
    identity: dict      # what makes a run this run (llmtrain.run.resume), recorded in the next checkpoints
    base: dict          # LoRA: the frozen base's fingerprint ({} without LoRA)


def _resume_point(cfg: Config, recipe: str, model_config, world_size: int) -> ResumePoint:
    """The checkpoint to resume from (corrupt ones are skipped), refused when saved by another setup, another
    budget or another LoRA base."""
    start = checkpoint.choose_resume(cfg.checkpoint, cfg.output_dir)
    # LoRA: the frozen base's fingerprint, recorded in checkpoints and checked against the one resumed from.
    base = lora.fingerprint(cfg.model.path, cfg.model.config, cfg.train.seed) if cfg.lora.enabled else {}
    changed, identity = [], resume.identity(cfg, recipe)  # the data files hashed once
    if start is not None:
        changed = resume.check(start, cfg, identity, model_config.to_dict(), world_size, checkpoint.STATE_FILE,
                               checkpoint.HF_CONFIG_DIR)
        saved_state = json.loads((start / checkpoint.STATE_FILE).read_text())
        resume.check_budget(start, saved_state["step"], cfg.train.max_steps)
        lora.check_resume(start, saved_state.get("base") or {}, base)
    return ResumePoint(start, changed, identity, base)


def _describe(metrics: MetricsLogger, cfg: Config, env: distributed.DistEnv, policy: BuiltModel, model_config,
              token_loss: loss_lib.TokenLoss | None, processor=None) -> None:
    """The set-up's log lines: the model and its strategy, attention, LoRA / NF4, the loss, a disk-space warning."""
    plan = policy.plan
    sp = f" as {env.dp_size} data-parallel x {env.sp_size} sequence-parallel" if env.sp_size > 1 else ""
    metrics.info(f"model: {policy.n_params / 1e6:.2f}M parameters | {env.world_size} x {env.device.type}{sp} "
                 f"({env.backend}) | strategy {plan.strategy.name} ({plan.reason}) | {cfg.parallel.mixed_precision}")
    _, attn_why = attention.choose(cfg.model.attn_implementation, model_config)
    if processor is not None:  # models.hf.load_model_config: transformers' own kernel for padded rows
        attn_why = f"{cfg.model.attn_implementation} (transformers'; rows with images are padded, not packed)"
    metrics.info(f"{plan.strategy.describe(policy.model)} | attention {attn_why}")
    if cfg.lora.enabled:
        metrics.info(f"lora: {policy.params_line} | r={cfg.lora.r} alpha={cfg.lora.alpha:g} | "
                     f"base {cfg.lora.base_dtype}")
    if policy.quantized is not None:
        metrics.info(policy.quantized.describe())
    if token_loss is not None:
        metrics.info(token_loss.describe())
    if warning := checkpoint.space_warning(cfg.output_dir, checkpoint.checkpoint_bytes(policy.model),
                                           _checkpoints_kept(cfg.checkpoint, cfg.train.max_steps),
                                           _export_size(cfg, policy), env.world_size):
        metrics.info(f"warning: {warning}")


def _earlier_run(output_dir: str) -> list[str]:
    """What an earlier run left in output_dir that a run starting over rewrites: its metrics and exports."""
    out = Path(output_dir)
    return [name for name in (METRICS_FILE, *(f"{d}/" for d in export_lib.LORA_OUTPUTS["both"]))
            if (out / name).exists()]


def _checkpoints_kept(section: CheckpointConfig, max_steps: int) -> int:
    """How many checkpoints the disk holds at once at most: keep_last, and the new one until it is complete
    (a preemption's save is not planned: not counted; a timer's counts as one)."""
    planned = max_steps // section.every_steps if section.every_steps else int(section.every_minutes > 0)
    return min(planned, section.keep_last + 1) if section.keep_last else planned


def _export_size(cfg: Config, policy: BuiltModel) -> int:
    """The exported weights: the whole model in export_dtype, or a LoRA adapter alone in fp32."""
    if cfg.lora.enabled and cfg.lora.export == "adapter":
        return policy.n_trained * 4
    return policy.n_params * DTYPES[cfg.checkpoint.export_dtype].itemsize


def build_data(run: Run, unit: str) -> data.Built:
    """The data (train and validation rows), logged; unit: what a row of the global batch is, for the log."""
    cfg, env = run.cfg, run.env
    built = data.build(cfg.data, run.tokenizer, cfg.train.seed, env.is_main, env.dp_rank, env.dp_size,
                       run.processor)
    if built.stats.untrained:  # every rank finds it alike: it would export the initial model
        raise ConfigError(built.stats.untrained)
    run.metrics.info(f"data: {built.stats.summary()} | global batch {run.global_batch} {unit} of "
                     f"{cfg.data.seq_len} tokens")
    if built.stats.template_note:
        run.metrics.info(built.stats.template_note)
    return built


def data_source(run: Run, built: data.Built) -> DataSource:
    """This rank's micro-batches of the global batches (one global order, whatever the world size or
    accumulation split; a sequence group's ranks get the same), from the saved position when resuming."""
    cfg, env = run.cfg, run.env
    return DataSource(data.make_steps(built, cfg.train.micro_batch_size, cfg.train.grad_accum_steps, env.dp_size,
                                      env.dp_rank, cfg.train.seed, env.device, run.state.data))


def sampling_weights(run: Run) -> dict[str, torch.Tensor]:
    """Collective: the policy as an engine with its own copy samples it (llmtrain.rollout.engine): by Hugging Face
    names, LoRA adapters merged into the base, on rank 0's CPU ({} on the other ranks)."""
    return export_lib.hf_state(run.model, run.plan.strategy, run.env.device,
                               run.cfg.lora if run.cfg.lora.enabled else None)


def export(run: Run, step_dir: str) -> list[Path]:
    """output_dir/hf[/step_dir]; with LoRA, as lora.export says, also output_dir/adapter[/step_dir]. A full disk
    waits up to checkpoint.export_wait_minutes for space (export_lib.write_until_fits); if the export still cannot be
    written, the error says which checkpoint holds the weights, if any."""
    cfg, env = run.cfg, run.env
    dtype, wait = DTYPES[cfg.checkpoint.export_dtype], cfg.checkpoint.export_wait_minutes
    try:
        if cfg.lora.enabled:
            return export_lib.export_lora(run.model, run.plan.strategy, env.device, Path(cfg.output_dir), step_dir,
                                          cfg.lora, cfg.model.path, run.model_config, run.tokenizer, dtype,
                                          cfg.checkpoint.max_shard_size, wait, run.processor)
        out = Path(cfg.output_dir) / "hf" / step_dir
        export_lib.export_hf(run.model, run.plan.strategy, env.device, out, run.model_config, run.tokenizer, dtype,
                             cfg.checkpoint.max_shard_size, wait, run.processor)
        return [out]
    except export_lib.ExportError as e:
        saved = checkpoint.complete_checkpoints(run.ckpt.root)
        if not saved:
            raise export_lib.ExportError(f"{e}; no checkpoint holds the trained weights: they are lost") from None
        step, path = saved[-1]
        raise export_lib.ExportError(f"{e}; the newest checkpoint, {path}, holds the weights of step {step}: "
                                     f"`python -m llmtrain.convert {path} OUT` writes the export from it") from None


def base_identity(run: Run) -> dict:
    """What model.path's base weights are, for caches keyed by them (DPO's precomputed reference log-probs):
    LoRA's recorded base fingerprint, or the same hash of model.path, and the dtype the base computes in."""
    cfg = run.cfg
    base = run.state.base or lora.fingerprint(cfg.model.path, cfg.model.config, cfg.train.seed)
    dtype = cfg.lora.base_dtype if cfg.lora.enabled else "fp32"
    if cfg.lora.enabled and cfg.lora.quantize_base == "nf4":
        dtype += f"+nf4/{cfg.lora.nf4_block_size}/{cfg.lora.nf4_scaler_block_size}"
    return {"weights": base["fingerprint"], "weights_dtype": dtype}
