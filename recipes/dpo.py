#!/usr/bin/env python
"""Preference tuning (DPO, IPO, SimPO) of a causal LM with DDP, FSDP or FSDP2, on GPUs (NCCL) or CPU (gloo).

    torchrun --nproc_per_node=N recipes/dpo.py --config configs/demo-dpo.yaml [key.sub=value ...]
    python recipes/dpo.py --help-config                        # every key (finetune's plus dpo.*)

The shared body (command line, model, optimizer, checkpoints, resume, preemption, loop, export) is
llmtrain.train, as for recipes/finetune.py; what is this recipe's own: the dpo: section, the reference
model, the step (one forward over a micro-batch's chosen and rejected rows, llmtrain.losses.preference) and eval.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout, installed or not

import torch  # noqa: E402

from llmtrain import data, distributed, parallelize, reference_cache  # noqa: E402
from llmtrain.models import hf as model_lib, lora  # noqa: E402
from llmtrain import train as trainer  # noqa: E402
from llmtrain.losses import preference as pl  # noqa: E402
from llmtrain.losses.preference import DPOConfig  # noqa: E402
from llmtrain.config import ConfigError  # noqa: E402
from llmtrain.losses.token import TokenLoss, trained_tokens  # noqa: E402
from llmtrain.step import StepResult, update  # noqa: E402


USAGE = """\
Preference tuning (DPO / IPO / SimPO) with DDP, FSDP or FSDP2 on GPUs (NCCL) or CPUs (gloo).

  torchrun --nproc_per_node=N recipes/dpo.py --config configs/demo-dpo.yaml [key.sub=value ...]

The data are pairs (data.format: preference): {"prompt", "chosen", "rejected"} as text, or as lists of
messages. model.path is the model to tune, usually a supervised fine-tune (configs/demo-dpo.yaml starts
from the SFT demo's export, outputs/demo/hf). With full fine-tuning the reference is a frozen copy of
model.path; with lora.enabled it is the same model with its adapters switched off; dpo.loss=simpo needs none.
dpo.precompute_reference=true scores every pair with it once before training (cached next to the tokenized
data, reused by later runs) and frees it.

Writes to output_dir what recipes/finetune.py writes; metrics.jsonl adds TRL's names: rewards/chosen,
rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected; with eval.every_steps,
val_loss and val_rewards/..., val_logps/... over the held-out pairs (data.val_path or data.val_fraction).
"""


def check(cfg: DPOConfig) -> None:
    """This recipe's set-up checks; the shared ones follow (llmtrain.train.setup)."""
    try:
        model_lib.check_paths(cfg.model, cfg.tokenizer.path)
    except ConfigError as e:
        raise ConfigError(f"{e} (recipes/dpo.py tunes an existing model; configs/demo-dpo.yaml starts from the SFT "
                          "demo's export: run torchrun --standalone --nproc_per_node=2 recipes/finetune.py "
                          "--config configs/demo.yaml first)") from None
    d = cfg.dpo
    pl.check(d.loss, d.beta, d.label_smoothing, d.gamma, d.sft_weight, d.precompute_reference)
    formats = {s.format for s in cfg.data.sources} if cfg.data.sources else {cfg.data.format}
    if formats != {"preference"}:
        raise ConfigError(f"data.format: recipes/dpo.py trains on pairs: set data.format=preference (got "
                          f"{', '.join(sorted(formats))})")
    if d.precompute_reference and cfg.eval.every_steps:
        raise ConfigError("dpo.precompute_reference covers the training pairs only, and eval.every_steps scores "
                          "the validation pairs with the reference; set eval.every_steps=0 or "
                          "dpo.precompute_reference=false")
    if cfg.train.loss_impl == "liger":
        raise ConfigError("train.loss_impl: recipes/dpo.py takes chunked (the default) or full; liger's fused "
                          "kernel yields only a summed loss, not the per-token log-probs DPO needs")


def pair_logps(model: torch.nn.Module, token_loss: TokenLoss, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over chosen and rejected rows -> (summed log-prob, trained tokens) per row, in fp32; with
    train.loss_impl=chunked no [rows x seq x vocab] logits exist."""
    return pl.sequence_logps(token_loss.token_logps(model, batch), batch["labels"])


def train(cfg: DPOConfig, env: distributed.DistEnv) -> torch.nn.Module:
    run = trainer.build(cfg, env)
    model, plan, d = run.model, run.plan, cfg.dpo

    def live_reference() -> reference_cache.Scorer:  # full fine-tuning: a frozen copy; LoRA: adapters off
        reference = model if cfg.lora.enabled else trainer.build_frozen(run)
        # A frozen copy gets its own output layer's TokenLoss, made here so that it is freed with the copy.
        ref_loss = run.token_loss if reference is model else TokenLoss(
            cfg.train.loss_impl, reference, env.device, cfg.train.loss_chunk_tokens)

        def reference_logps(batch: dict) -> torch.Tensor:
            off = lora.adapters_disabled(model) if cfg.lora.enabled else contextlib.nullcontext()
            with torch.no_grad(), off, parallelize.autocast(plan, env.device):
                return pair_logps(reference, ref_loss, batch)[0]
        return reference_logps

    has_reference = d.loss not in pl.REFERENCE_FREE
    reference_logps = live_reference() if has_reference and not d.precompute_reference else None
    run.metrics.info(f"dpo: loss {d.loss}, beta {d.beta:g}, reference "
                     + ("none" if not has_reference else "adapters off" if cfg.lora.enabled else "frozen copy")
                     + (", precomputed" if d.precompute_reference else ""))
    built, steps = trainer.data_steps(run, pairs=True)
    if d.precompute_reference:  # scored once (or read back) here; no reference model during training
        base = run.state.base or lora.fingerprint(cfg.model.path, cfg.model.config, cfg.train.seed)  # LoRA: build's
        where = reference_cache.directory(
            built.train, Path(cfg.output_dir), seq_len=cfg.data.seq_len, compute=cfg.parallel.mixed_precision,
            weights=base["fingerprint"],
            weights_dtype=cfg.lora.base_dtype if cfg.lora.enabled else "fp32")
        reference_logps = reference_cache.precompute(where, len(built.train), lambda p: data.pairs_batch(built, p),
                                                     cfg.train.micro_batch_size, live_reference, env, run.metrics.info)

    def step(batches: list[dict]) -> StepResult:
        batches = [{k: v.to(env.device, non_blocking=True) for k, v in b.items()} for b in batches]
        # The step's denominators (pairs, chosen tokens) over every micro-batch and rank, before any forward.
        totals = distributed.all_reduce(torch.stack([pl.pair_counts(b["labels"]) for b in batches]).sum(0))
        n_tokens = int(distributed.all_reduce(sum(trained_tokens(b["labels"]) for b in batches)).item())
        loss_sum = torch.zeros((), device=env.device)
        summed = torch.zeros(len(pl.METRICS), device=env.device)
        for i, batch in enumerate(batches):
            ref = reference_logps(batch) if reference_logps is not None else None
            with parallelize.grad_sync(model, plan, enabled=i == len(batches) - 1):
                with parallelize.autocast(plan, env.device):
                    logps, lengths = pair_logps(model, run.token_loss, batch)
                sums = pl.preference_sums(logps, lengths, ref, d.loss, d.beta, d.label_smoothing, d.gamma)
                part = pl.objective(sums, totals, d.sft_weight)
                # Data-parallel wrappers average gradients over ranks: x world size makes them the global mean's.
                (run.scaler.scale(part * env.world_size) if run.scaler else part * env.world_size).backward()
            loss_sum += part.detach()
            summed += sums.metrics
        loss = distributed.all_reduce(loss_sum).item()
        extra = pl.metrics(distributed.all_reduce(summed), int(totals[0]))
        grad_norm, ok = update(model, plan, run.opt, run.scaler, cfg.train.max_grad_norm, loss)
        return StepResult(loss, grad_norm, n_tokens, ok, extra)

    def evaluate(at_step: int) -> None:
        def logps(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
            with parallelize.autocast(plan, env.device):
                return (*pair_logps(model, run.token_loss, batch),
                        reference_logps(batch) if reference_logps is not None else None)

        batches = data.eval_batches(built.val, cfg.train.micro_batch_size, env.world_size, env.rank,
                                    cfg.eval.max_batches, built.collate)
        run.metrics.log({"step": at_step, **pl.evaluate(model, batches, logps, env.device, d)})

    return trainer.loop(run, steps, step, evaluate)


def main(argv: list[str] | None = None) -> int:
    return trainer.main(argv, USAGE, DPOConfig, train, check)


if __name__ == "__main__":
    distributed.hard_exit(main())
