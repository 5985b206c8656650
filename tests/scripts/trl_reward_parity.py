"""llmtrain's reward-model loss (llmtrain.losses.reward, recipes/reward.py) against TRL's RewardTrainer on the same
sequence classifier and pairs: loss, metrics and the gradient of every parameter, with and without a margin and
centring.

TRL is a dev-only comparison, kept out of llmtrain's environment; run this with a Python that has trl installed
(TRL 1.16 was checked; `python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 trl==1.16.0`), from
the repo root:

    PYTHONPATH=. .venv-trl/bin/python tests/scripts/trl_reward_parity.py

The pairs are llmtrain's collated demo pairs, handed to RewardTrainer.compute_loss in TRL's layout (the chosen
rows then the rejected rows, an attention mask, the margins); both read the score at each row's last non-pad
token through the trainer's own model. Prints one line per case with the largest |difference| and exits non-zero
above 1e-6."""

from __future__ import annotations

import sys
import tempfile

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForSequenceClassification
from trl import RewardConfig, RewardTrainer
from trl_orpo_cpo_parity import compare, demo_pairs, grads  # this script's directory: sys.path[0]

from llmtrain.losses import reward as rl

PAIRS = 8
TOL = 1e-6
CASES = {"plain": (False, None), "margin": (True, None), "centred": (False, 0.01), "margin+centred": (True, 0.3)}


def tiny(pad_id: int) -> LlamaForSequenceClassification:
    torch.manual_seed(0)
    return LlamaForSequenceClassification(LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, num_labels=1, pad_token_id=pad_id))


def main() -> int:
    tok, records, batch = demo_pairs(PAIRS)
    ids = batch["input_ids"]
    margin = torch.linspace(0.0, 1.5, PAIRS)
    worst = 0.0
    for name, (with_margin, center) in CASES.items():
        with tempfile.TemporaryDirectory() as out:
            args = RewardConfig(output_dir=out, report_to="none", use_cpu=True, center_rewards_coefficient=center,
                                per_device_train_batch_size=PAIRS)
            trainer = RewardTrainer(model=tiny(tok.pad_token_id), args=args, processing_class=tok,
                                    train_dataset=Dataset.from_list(records))
            model = trainer.model.float().train()
            inputs = {"input_ids": ids, "attention_mask": (ids != tok.pad_token_id).long()}
            if with_margin:
                inputs["margin"] = margin
            theirs = trainer.compute_loss(model, dict(inputs))
            theirs.backward()
            their_grads = grads(model)
            their_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k in rl.METRICS}
            rewards = model(input_ids=ids, position_ids=batch["position_ids"]).logits[:, 0]
            sums = rl.reward_sums(rewards, margin if with_margin else None, center or 0.0)
            mine = sums.loss / PAIRS
            mine.backward()
            my_grads = grads(model)
        mine_metrics = rl.metrics(sums.sums, sums.extrema, PAIRS)
        worst = max(worst, compare(name, mine, theirs, mine_metrics, their_metrics, my_grads, their_grads))
    return 0 if worst < TOL else 1


if __name__ == "__main__":
    sys.exit(main())
