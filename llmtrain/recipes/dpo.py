"""Preference tuning (recipes/dpo.py): DPO, IPO, SimPO, ORPO, CPO. What is this recipe's own: the dpo: section, the
reference (one factory: none, live or precomputed), the objective (one forward over a micro-batch's chosen and
rejected rows, llmtrain.losses.preference) and eval; the rest is the shared body's (llmtrain/recipes/base.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from llmtrain import data
from llmtrain.config import Config, ConfigError, ranged
from llmtrain.losses import preference as pl
from llmtrain.recipes.base import Recipe
from llmtrain.train.build import base_identity
from llmtrain.train import reference_cache
from llmtrain.train.frozen import reference
from llmtrain.train.step import Share

USAGE = """\
Preference tuning (DPO / IPO / SimPO / ORPO / CPO) with DDP, FSDP or FSDP2 on GPUs (NCCL) or CPUs (gloo).

  torchrun --nproc_per_node=N recipes/dpo.py --config configs/demo-dpo.yaml [key.sub=value ...]

The data are pairs (data.format: preference): {"prompt", "chosen", "rejected"} as text, or as lists of
messages. model.path is the model to tune, usually a supervised fine-tune (configs/demo-dpo.yaml starts
from the SFT demo's export, outputs/demo/hf). With full fine-tuning the reference is a frozen copy of
model.path; with lora.enabled it is the same model with its adapters switched off; dpo.loss=simpo, orpo and
cpo need none.
dpo.precompute_reference=true scores every pair with it once before training (cached next to the tokenized
data, reused by later runs) and frees it.

Writes to output_dir what recipes/finetune.py writes; metrics.jsonl adds TRL's names: rewards/chosen,
rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected (orpo, cpo: nll_loss;
orpo: log_odds_ratio, log_odds_chosen); with eval.every_steps,
val_loss and val_rewards/..., val_logps/... over the held-out pairs (data.val_path or data.val_fraction).
"""



@dataclass
class DPOSection:
    loss: Literal["sigmoid", "ipo", "simpo", "orpo", "cpo"] = "sigmoid"
    """sigmoid: DPO (Rafailov 2023) | ipo: IPO (Azar 2023, per-token normalised) | simpo: SimPO (Meng 2024),
    reference-free | orpo: ORPO (Hong 2024, TRL's ORPOTrainer), reference-free, odds ratio + chosen NLL |
    cpo: CPO (Xu 2024, TRL's CPOTrainer), reference-free, dpo.cpo_loss_type + dpo.cpo_alpha x chosen NLL."""
    beta: float = ranged("(0, inf)", default=0.1)
    """Strength of the pull towards the reference (sigmoid, ipo); SimPO's and CPO's reward scale; ORPO's
    lambda (the odds-ratio term's weight)."""
    label_smoothing: float = ranged("[0, 0.5)", default=0.0)
    """sigmoid / simpo / cpo (sigmoid, simpo): assumed probability that a pair's labels are flipped (conservative
    DPO); in [0, 0.5)."""
    gamma: float = ranged("[0, inf)", default=0.0)
    """simpo, cpo with cpo_loss_type=simpo: target reward margin (TRL's simpo_gamma)."""
    cpo_loss_type: Literal["sigmoid", "hinge", "ipo", "simpo"] = "sigmoid"
    """cpo: TRL's CPOConfig.loss_type; sigmoid and hinge on summed log-probs, ipo and simpo on per-token
    averages."""
    cpo_alpha: float = ranged("[0, inf)", default=pl.CPO_ALPHA)
    """cpo: weight of the chosen responses' mean token NLL (TRL's cpo_alpha; 0 with cpo_loss_type=simpo is
    SimPO)."""
    sft_weight: float = ranged("[0, inf)", default=0.0)
    """sigmoid, ipo, simpo: adds sft_weight x the chosen responses' mean token NLL to the loss (keeps their
    likelihood up)."""
    precompute_reference: bool = False
    """sigmoid, ipo: score every training pair with the reference once before training, cached next to the
    tokenized data and reused by later runs; training then holds no reference model (less memory, no reference
    forward per step)."""


@dataclass
class DPOConfig(Config):
    """recipes/dpo.py's Config: the shared sections plus dpo:."""
    dpo: DPOSection = field(default_factory=DPOSection)


def pair_logps(model: torch.nn.Module, token_loss, batch: dict,
               loss: str = "sigmoid") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward over chosen and rejected rows -> (summed log-prob, trained tokens) per row, in fp32, and the
    NLL term's numerator (pl.response_logps); with train.loss_impl=chunked no [rows x seq x vocab] logits exist."""
    scored = pl.scored_labels(loss, batch)
    return pl.response_logps(token_loss.token_logps(model, {**batch, "labels": scored}), scored, batch["labels"])


class DPO(Recipe):
    name = "dpo"
    config_cls = DPOConfig
    usage = USAGE
    rows = "pairs"
    unit = "pairs"
    per_token_logps = True
    sequence_parallel = True  # TokenLoss gives the whole rows' log-probs on each rank of a sequence group

    def check(self, cfg: DPOConfig) -> None:
        self.check_existing_model(cfg, "configs/demo-dpo.yaml")
        d = cfg.dpo
        pl.check_settings(d.loss, d.label_smoothing, d.gamma, d.precompute_reference, d.cpo_loss_type, d.cpo_alpha,
                          d.sft_weight)
        if d.precompute_reference and cfg.eval.every_steps:
            raise ConfigError("dpo.precompute_reference covers the training pairs only, and eval.every_steps "
                              "scores the validation pairs with the reference; set eval.every_steps=0 or "
                              "dpo.precompute_reference=false")

    def setup(self, run, built) -> None:
        super().setup(run, built)
        self.section, self.built, self.objective = run.cfg.dpo, built, self
        self.reference_logps = self.reference(run, built)

    def reference(self, run, built):
        """batch -> the reference's summed log-prob per row, or None (reference-free): live (a frozen copy, or
        the policy with adapters off), or precomputed once over every training pair and looked up."""
        d, cfg = self.section, run.cfg
        if d.loss in pl.REFERENCE_FREE:
            run.metrics.info(f"dpo: loss {d.loss}, beta {d.beta:g}, reference none")
            return None

        def live():
            ref = reference(run)
            run.metrics.info(f"dpo: loss {d.loss}, beta {d.beta:g}, reference {ref.kind}"
                             + (", precomputed" if d.precompute_reference else ""))
            return lambda batch: ref.forward(lambda model, token_loss: pair_logps(model, token_loss, batch)[0])

        if not d.precompute_reference:
            return live()
        where = reference_cache.directory(built.train, Path(cfg.output_dir), seq_len=cfg.data.seq_len,
                                          compute=cfg.parallel.mixed_precision, **base_identity(run))
        return reference_cache.precompute(where, len(built.train), lambda p: data.pairs_batch(built, p),
                                          cfg.train.micro_batch_size, live, run.env, run.metrics.info)

    # -- the objective: sums over a micro-batch's pairs / global pairs and chosen tokens ----------------
    def counts(self, batch: dict) -> torch.Tensor:
        return pl.pair_counts(pl.scored_labels(self.section.loss, batch))

    def share(self, model, batch: dict, totals: torch.Tensor) -> Share:
        ref = self.reference_logps(batch) if self.reference_logps is not None else None
        d = self.section
        logps, lengths, nll = pair_logps(model, self.run.token_loss, batch, d.loss)
        sums = pl.preference_sums(logps, lengths, ref, d.loss, d.beta, d.label_smoothing, d.gamma, d.cpo_loss_type,
                                  nll)
        part = pl.objective(sums, totals[1:], pl.nll_weight(d.loss, d.sft_weight, d.cpo_alpha))
        return Share(part, torch.cat([part.detach().reshape(1), sums.metrics]))

    def report(self, metrics: torch.Tensor, totals: torch.Tensor) -> tuple[float, dict]:
        return metrics[0].item(), pl.metrics(metrics[1:], int(totals[1]), self.section.loss, int(totals[2]))

    def evaluate(self, at_step: int) -> dict:
        run, cfg = self.run, self.run.cfg

        def logps(batch: dict):
            with run.autocast():
                return (*pair_logps(run.model, run.token_loss, batch, self.section.loss),
                        self.reference_logps(batch) if self.reference_logps is not None else None)

        batches = data.eval_batches(self.built.val, cfg.train.micro_batch_size, run.env.dp_size, run.env.dp_rank,
                                    cfg.eval.max_batches, self.built.collate)
        d = self.section
        return pl.evaluate(run.model, batches, logps, run.env.device, d.loss, d.beta, d.label_smoothing, d.gamma,
                           pl.nll_weight(d.loss, d.sft_weight, d.cpo_alpha), d.cpo_loss_type, run.env.sp_group)

