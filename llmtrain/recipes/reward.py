"""Reward-model training (recipes/reward.py): a Bradley–Terry reward model on preference pairs, TRL's
RewardTrainer counterpart. What is this recipe's own: the reward: section, the policy built as a one-score
sequence classifier (Recipe.score_head: transformers' AutoModelForSequenceClassification, num_labels 1, on
model.path's body), the objective (one forward over a micro-batch's chosen and rejected rows,
llmtrain.losses.reward) and eval; the rest is the shared body's (llmtrain/recipes/base.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmtrain import data
from llmtrain.config import Config, ConfigError, ranged
from llmtrain.data.formats import IGNORE
from llmtrain.losses import reward as rl
from llmtrain.recipes.base import Recipe
from llmtrain.train.step import Share, combined

USAGE = """\
Reward-model training (Bradley-Terry, as TRL's RewardTrainer) with DDP, FSDP or FSDP2 on GPUs (NCCL) or CPUs (gloo).

  torchrun --nproc_per_node=N recipes/reward.py --config configs/demo-reward.yaml [key.sub=value ...]

The data are pairs (data.format: preference): {"prompt", "chosen", "rejected"} as text, or as lists of
messages. model.path is the causal LM whose body the reward model starts from (configs/demo-reward.yaml
starts from the SFT demo's export, outputs/demo/hf); its score head (transformers' sequence-classification
class for the family, one label) starts seeded and reads the last token that is not padding. With
lora.enabled, add score to lora.modules_to_save so the head trains with the adapters.

Writes to output_dir what recipes/finetune.py writes (hf/ loads with AutoModelForSequenceClassification);
metrics.jsonl adds TRL's names: accuracy, margin, mean_reward, min_reward, max_reward; with eval.every_steps,
val_loss and val_accuracy, ... over the held-out pairs (data.val_path or data.val_fraction).
"""


@dataclass
class RewardSection:
    center_rewards_coefficient: float = ranged("[0, inf)", default=0.0)
    """Adds this x the mean over pairs of (chosen + rejected reward)^2, pulling the rewards towards zero mean
    (TRL's center_rewards_coefficient; Eisenstein et al. 2023); 0 = off."""


@dataclass
class RewardConfig(Config):
    """recipes/reward.py's Config: the shared sections plus reward:."""
    reward: RewardSection = field(default_factory=RewardSection)


def scores(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """One forward over chosen and rejected rows -> one reward per row (the head reads each row's last
    non-pad token, as transformers' sequence classifiers do), fp32."""
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[:, 0].float()


class Reward(Recipe):
    name = "reward"
    config_cls = RewardConfig
    usage = USAGE
    rows = "pairs"
    unit = "pairs"
    score_head = True

    def check(self, cfg: RewardConfig) -> None:
        self.check_existing_model(cfg, "configs/demo-reward.yaml")
        if cfg.lora.enabled and "score" not in cfg.lora.modules_to_save:
            raise ConfigError("lora.modules_to_save: a reward model's score head starts untrained, so it must train "
                              "with the adapters; add score (lora.modules_to_save=[score])")
        if cfg.train.loss_impl != "chunked":
            raise ConfigError(f"train.loss_impl={cfg.train.loss_impl}: recipes/reward.py reads one score per row and "
                              "no token logits, so the token loss's implementation does not apply; leave it unset")

    def setup(self, run, built) -> None:
        super().setup(run, built)
        self.built, self.section, self.objective = built, run.cfg.reward, self

    # -- the objective: sums over a micro-batch's pairs / global pairs ---------------------------------
    def counts(self, batch: dict) -> torch.Tensor:
        return torch.tensor([batch["labels"].shape[0] // 2], device=batch["labels"].device)

    def share(self, model, batch: dict, totals: torch.Tensor) -> Share:
        sums = rl.reward_sums(scores(model, batch), batch.get("margin"), self.section.center_rewards_coefficient)
        part = sums.loss / totals[1]
        return Share(part, torch.cat([part.detach().reshape(1), sums.sums]), maxima=sums.extrema)

    def report(self, metrics: torch.Tensor, totals: torch.Tensor) -> tuple[float, dict]:
        return metrics[0].item(), rl.metrics(metrics[1:-2], metrics[-2:], int(totals[1]))  # maxima: [max, -min]

    def evaluate(self, at_step: int) -> dict:
        """val_loss and val_<METRICS> over every rank's held-out pairs: each micro-batch's sums and extrema combined
        as a step's shares are (step.combined: summed, the extrema with MAX), so global values whatever the world
        size. Collective: every rank passes as many batches (eval_batches)."""
        run, cfg = self.run, self.run.cfg
        batches = data.eval_batches(self.built.val, cfg.train.micro_batch_size, run.env.world_size, run.env.rank,
                                    cfg.eval.max_batches, self.built.collate)
        was_training = run.model.training
        run.model.eval()
        with torch.no_grad():
            shares = [self.held_out({k: v.to(run.env.device) for k, v in batch.items()}) for batch in batches]
        run.model.train(was_training)
        summed = combined(shares)  # loss, pairs, accuracy, margin, rewards; then [max, -min]
        pairs = int(summed[1])
        return {"val_loss": summed[0].item() / max(pairs, 1),
                **{f"val_{k}": v for k, v in rl.metrics(summed[2:-2], summed[-2:], pairs).items()}}

    def held_out(self, batch: dict) -> Share:
        """One validation micro-batch's sums (loss, pairs, then rl.reward_sums') and extrema; nothing from
        eval_batches' filler for a rank out of pairs, whose forward it still runs (a collective under FSDP)."""
        with self.run.autocast():
            rewards = scores(self.run.model, batch)
        if (batch["labels"] == IGNORE).all():
            return Share(None, rewards.new_zeros(5, dtype=torch.float64),
                         maxima=rewards.new_full((2,), -torch.inf, dtype=torch.float64))
        s = rl.reward_sums(rewards, batch.get("margin"), self.section.center_rewards_coefficient)
        pairs = rewards.new_tensor([rewards.shape[0] // 2])
        return Share(None, torch.cat([s.loss.reshape(1), pairs, s.sums]).double(), maxima=s.extrema.double())
