"""KTO (recipes/kto.py): Kahneman-Tversky Optimization on unpaired thumbs-up / thumbs-down data, TRL's KTOTrainer
counterpart. What is this recipe's own: the kto: section, the data's KL rows (llmtrain.data.unpaired), the
reference (as DPO's: a frozen copy, the policy with adapters off, or precomputed), the objective (the step's KL
point from every micro-batch's KL rows before any loss, then one forward per micro-batch, llmtrain.losses.kto);
the rest is the shared body's (llmtrain/recipes/base.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from llmtrain import data
from llmtrain.config import Config, ConfigError, ranged
from llmtrain.data.formats import IGNORE
from llmtrain.data.unpaired import with_kl_completions
from llmtrain.losses import kto as kl_lib
from llmtrain.losses.preference import sequence_logps
from llmtrain.recipes.base import Recipe
from llmtrain.train.build import base_identity, build_data, data_source
from llmtrain.train import reference_cache
from llmtrain.train.frozen import reference
from llmtrain.train.step import Share, combined

USAGE = """\
KTO (Kahneman-Tversky Optimization, as TRL's KTOTrainer) with DDP, FSDP or FSDP2 on GPUs (NCCL) or CPUs (gloo).

  torchrun --nproc_per_node=N recipes/kto.py --config configs/demo-kto.yaml [key.sub=value ...]

The data are unpaired rows (data.format: unpaired): {"prompt", "completion", "label"} as text, or prompt and
completion as lists of messages; label true marks a desirable completion, false an undesirable one, and the data
need both. model.path is the model to tune, usually a supervised fine-tune (configs/demo-kto.yaml starts from the
SFT demo's export, outputs/demo/hf). With full fine-tuning the reference is a frozen copy of model.path; with
lora.enabled it is the same model with its adapters switched off; kto.precompute_reference=true scores every row
(and its KL row) with it once before training and frees it. The KL point is estimated from each row's prompt with
another row's completion (TRL's rotation within chunks of the global batch) over the step's whole global batch.

Writes to output_dir what recipes/finetune.py writes; metrics.jsonl adds TRL's names: rewards/chosen,
rewards/rejected, rewards/margins, logps/chosen, logps/rejected (means over the step's desirable / undesirable
rows) and kl (the KL point); with eval.every_steps, val_loss, val_kl, val_rewards/chosen, ... over the held-out
rows (data.val_path or data.val_fraction), their KL point from their own KL rows.
"""


@dataclass
class KTOSection:
    loss_type: Literal["kto", "apo_zero_unpaired"] = "kto"
    """kto: KTO (Ethayarajh 2024), the rewards measured against the KL point | apo_zero_unpaired: APO-zero
    (D'Oosterlinck 2024), unpaired, no KL point (no KL rows are scored)."""
    beta: float = ranged("(0, inf)", default=0.1)
    """Strength of the pull towards the reference: the rewards are beta x (policy - reference) log-prob."""
    desirable_weight: float = ranged("(0, inf)", default=1.0)
    """Weight of the desirable rows' losses (TRL's desirable_weight); with fewer desirable than undesirable rows,
    the KTO paper suggests desirable_weight x desirable rows / (undesirable_weight x undesirable rows) in
    [1, 4/3]."""
    undesirable_weight: float = ranged("(0, inf)", default=1.0)
    """Weight of the undesirable rows' losses (TRL's undesirable_weight)."""
    precompute_reference: bool = False
    """Score every training row and its KL row with the reference once before training, cached next to the
    tokenized data and reused by later runs; training then holds no reference model."""


@dataclass
class KTOConfig(Config):
    """recipes/kto.py's Config: the shared sections plus kto:."""
    kto: KTOSection = field(default_factory=KTOSection)


def rows_of(batch: dict, kl: bool = False) -> dict:
    """The batch's rows (or, kl=True, its KL rows) as a forward takes them."""
    prefix = "kl_" if kl else ""
    return {k: batch[prefix + k] for k in ("input_ids", "labels", "position_ids")}


def completion_logps(model: torch.nn.Module, token_loss, rows: dict) -> torch.Tensor:
    """One forward -> each row's summed completion log-prob, fp32; with train.loss_impl=chunked no
    [rows x seq x vocab] logits exist."""
    return sequence_logps(token_loss.token_logps(model, rows), rows["labels"])[0]


class KTO(Recipe):
    name = "kto"
    config_cls = KTOConfig
    usage = USAGE
    rows = "unpaired"
    unit = "rows"
    per_token_logps = True

    def check(self, cfg: KTOConfig) -> None:
        self.check_existing_model(cfg, "configs/demo-kto.yaml")
        if cfg.eval.every_steps and cfg.kto.precompute_reference:
            raise ConfigError("eval.every_steps: kto.precompute_reference scores the training rows only and frees the "
                              "reference, so the validation rows have none; set eval.every_steps=0 or "
                              "kto.precompute_reference=false")
        if cfg.data.streaming:
            raise ConfigError("data.streaming: KTO's KL rows pair each row with another row's completion in stored "
                              "order, which a stream does not have; set data.streaming=false")

    def source(self, run):
        built = build_data(run, self.unit)
        rows = built.train.with_format(None)
        desirable = sum(rows["label"])
        kl_lib.check_sides(desirable, len(rows) - desirable, "the training data")
        built.train = with_kl_completions(rows, run.global_batch, run.cfg.data.seq_len).with_format("torch")
        if built.val is not None:  # the held-out rows' KL rows: the same rotation, within their own chunks
            built.val = with_kl_completions(built.val.with_format(None), run.global_batch,
                                            run.cfg.data.seq_len).with_format("torch")
        return built, data_source(run, built)

    def setup(self, run, built) -> None:
        super().setup(run, built)
        self.built, self.section, self.objective = built, run.cfg.kto, self
        self.reference_logps = self.reference(run, built)

    def reference(self, run, built):
        """(batch, kl) -> the reference's summed log-prob of each of the batch's rows (kl=True: of its KL rows):
        live (a frozen copy, or the policy with adapters off), or precomputed once over every training row and
        looked up."""
        k, cfg = self.section, run.cfg

        def live():
            ref = reference(run)
            run.metrics.info(f"kto: loss {k.loss_type}, beta {k.beta:g}, reference {ref.kind}"
                             + (", precomputed" if k.precompute_reference else ""))
            return lambda rows: ref.forward(lambda model, token_loss: completion_logps(model, token_loss, rows))

        if not k.precompute_reference:
            score = live()
            return lambda batch, kl: score(rows_of(batch, kl))

        def both():  # the cache's layout: each row's value, then its KL row's (0 without a KL point)
            score = live()
            return lambda batch: torch.cat([score(rows_of(batch)), score(rows_of(batch, kl=True))
                                            if kl_lib.uses_kl(k.loss_type) else batch["label"].new_zeros(
                                                batch["label"].shape, dtype=torch.float32)])

        where = reference_cache.directory(built.train, Path(cfg.output_dir), seq_len=cfg.data.seq_len,
                                          compute=cfg.parallel.mixed_precision, loss_type=k.loss_type,
                                          **base_identity(run))
        table = reference_cache.precompute(where, len(built.train), lambda p: data.pairs_batch(built, p),
                                           cfg.train.micro_batch_size, both, run.env, run.metrics.info)
        return lambda batch, kl: table(batch).chunk(2)[int(kl)]

    # -- the objective: totals[1:] = [desirable rows, undesirable rows, Σ KL-row log-ratios] of the step --------
    def counts(self, batch: dict) -> torch.Tensor:
        sides = kl_lib.side_counts(batch["label"]).double()
        if not kl_lib.uses_kl(self.section.loss_type):
            return torch.cat([sides, sides.new_zeros(1)])
        run = self.run
        with torch.no_grad(), run.autocast():  # z0 takes no gradient: the policy's KL rows, as TRL's
            policy = completion_logps(run.model, run.token_loss, rows_of(batch, kl=True))
        ref = self.reference_logps(batch, True)
        return torch.cat([sides, kl_lib.kl_sums(policy, ref).reshape(1)])

    def kl(self, totals: torch.Tensor) -> torch.Tensor:
        return kl_lib.kl_point(totals[3], totals[1] + totals[2])

    def share(self, model, batch: dict, totals: torch.Tensor) -> Share:
        k = self.section
        ref = self.reference_logps(batch, False)
        logps = completion_logps(model, self.run.token_loss, rows_of(batch))
        sums = kl_lib.kto_sums(logps, ref, batch["label"], self.kl(totals), k.beta, k.desirable_weight,
                               k.undesirable_weight, k.loss_type)
        part = kl_lib.objective(sums, (totals[1] + totals[2]).float())
        return Share(part, torch.cat([part.detach().reshape(1), sums.metrics]))

    def report(self, metrics: torch.Tensor, totals: torch.Tensor) -> tuple[float, dict]:
        return metrics[0].item(), kl_lib.metrics(metrics[1:], int(totals[1]), int(totals[2]), self.kl(totals).item())

    def evaluate(self, at_step: int) -> dict:
        """val_loss and val_<TRL's names> over every rank's held-out rows, as the training step computes them with
        the held-out set as one batch: z0 from all its KL rows (a first pass, combined over ranks), then every
        row's loss and metrics against that z0 (a second pass). So the values are the same whatever the world size.
        Collective: every rank passes as many batches (eval_batches), filler included."""
        run, cfg = self.run, self.run.cfg

        def passes(sums):
            batches = data.eval_batches(self.built.val, cfg.train.micro_batch_size, run.env.world_size,
                                        run.env.rank, cfg.eval.max_batches, self.built.collate)
            shares = []
            for batch in batches:
                batch = {k: v.to(run.env.device) for k, v in batch.items()}
                part = sums(batch)  # every rank runs the forwards, even on eval_batches' filler
                shares.append(Share(None, part.zero_() if (batch["labels"] == IGNORE).all() else part))
            return combined(shares)

        was_training = run.model.training
        run.model.eval()
        with torch.no_grad():
            counts = passes(self.counts)  # desirable rows, undesirable rows, Σ KL-row log-ratios
            kl = kl_lib.kl_point(counts[2], counts[0] + counts[1])  # 0 for apo_zero_unpaired: no KL rows scored
            summed = passes(lambda batch: self.held_out(batch, kl))
        run.model.train(was_training)
        rows = max(int(counts[0] + counts[1]), 1)
        means = kl_lib.metrics(summed[1:], int(counts[0]), int(counts[1]), kl.item())
        return {"val_loss": summed[0].item() / rows, **{f"val_{k}": v for k, v in means.items()}}

    def held_out(self, batch: dict, kl: torch.Tensor) -> torch.Tensor:
        """One validation micro-batch's [Σ loss, RowSums.metrics] against the held-out set's z0."""
        k = self.section
        with self.run.autocast():
            logps = completion_logps(self.run.model, self.run.token_loss, rows_of(batch))
        sums = kl_lib.kto_sums(logps, self.reference_logps(batch, False), batch["label"], kl, k.beta,
                               k.desirable_weight, k.undesirable_weight, k.loss_type)
        return torch.cat([sums.loss.detach().reshape(1), sums.metrics]).double()
