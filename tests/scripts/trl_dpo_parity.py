"""llmtrain's preference losses and metrics against TRL's own, on the same tiny models and demo pairs.

TRL is a dev-only comparison, kept out of llmtrain's environment; run this with a Python that has
trl installed (TRL 1.16 was checked), from the repo root:

    PYTHONPATH=. /path/to/trl-venv/bin/python tests/scripts/trl_dpo_parity.py

DPO (sigmoid), IPO and DPO + SFT go through DPOTrainer's own tokenization, collator, policy log-probs
and loss; the reference log-probs enter through TRL's precomputed-reference inputs, taken from an
unpatched copy of the reference model (a model DPOTrainer has patched gives plain-forward logits ~2e-3
away from the same weights unpatched, with TRL 1.16 + transformers 5.24 on CPU; not chased further).
SimPO, which TRL has in CPOTrainer only, goes through CPOTrainer.cpo_loss on llmtrain's per-token
average log-probs.
Prints one line per case with the largest |difference| and exits non-zero above 1e-5."""

from __future__ import annotations

import json
import sys
import tempfile
import types
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from trl import DPOConfig, DPOTrainer
from trl.experimental.cpo import CPOTrainer

from llmtrain.losses import preference as pl
from llmtrain.config import DataConfig
from llmtrain.data.preference import collate_pairs, encode_preference

REPO = Path(__file__).resolve().parents[2]
PAIRS = 8


def tiny(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))


def ours(records, tok, loss, beta, gamma=0.0, sft=0.0):
    policy, reference = tiny(0), tiny(1)
    batch = collate_pairs([encode_preference(r, DataConfig(seq_len=128), tok) for r in records], tok.pad_token_id)
    inputs = {k: batch[k] for k in ("input_ids", "position_ids")}
    logps, lengths = pl.sequence_logps(pl.token_logps(policy(**inputs).logits, batch["labels"]), batch["labels"])
    with torch.no_grad():
        ref = pl.sequence_logps(pl.token_logps(reference(**inputs).logits, batch["labels"]), batch["labels"])[0]
    sums = pl.preference_sums(logps, lengths, None if loss == "simpo" else ref, loss, beta, gamma=gamma)
    value = pl.objective(sums, pl.pair_counts(batch["labels"]), sft).item()
    return value, pl.metrics(sums.metrics, PAIRS), logps, lengths, ref


def trl_dpo(records, tok, loss_types, weights, beta, ref):
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, beta=beta, loss_type=loss_types, loss_weights=weights, report_to="none",
                         use_cpu=True, per_device_train_batch_size=PAIRS, max_length=None)
        trainer = DPOTrainer(model=tiny(0), ref_model=tiny(1), args=args, processing_class=tok,
                             train_dataset=Dataset.from_list(records))
        inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(PAIRS)])
        trainer.precompute_ref_logps = True
        inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = ref.chunk(2)
        loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False).item()
        return loss, {k: v[-1] for k, v in trainer._metrics["train"].items() if k in pl.METRICS}


def main() -> int:
    tok = AutoTokenizer.from_pretrained(REPO / "assets" / "tokenizer")
    records = [json.loads(line) for line in (REPO / "data" / "demo" / "preference.jsonl").open()][:PAIRS]
    worst = 0.0
    cases = [("sigmoid", "sigmoid", ["sigmoid"], None, 0.1, 0.0), ("ipo", "ipo", ["ipo"], None, 0.3, 0.0),
             ("sigmoid+sft", "sigmoid", ["sigmoid", "sft"], [1.0, 0.5], 0.1, 0.5)]
    for name, loss, types_, weights, beta, sft in cases:
        mine, mine_metrics, _, _, ref = ours(records, tok, loss, beta, sft=sft)
        theirs, their_metrics = trl_dpo(records, tok, types_, weights, beta, ref)
        d = max([abs(mine - theirs)] + [abs(mine_metrics[k] - their_metrics[k]) for k in pl.METRICS])
        print(f"{name:12s} loss {mine:.6f} (TRL {theirs:.6f})  max |d| over loss and 6 metrics {d:.2e}")
        worst = max(worst, d)
    # SimPO: TRL's CPOTrainer.cpo_loss on the same average log-probs, with its metric definitions.
    beta, gamma = 2.0, 0.5
    mine, mine_metrics, logps, lengths, _ = ours(records, tok, "simpo", beta, gamma=gamma)
    average = (logps / lengths).detach()
    cpo = types.SimpleNamespace(alpha=0.0, beta=beta, simpo_gamma=gamma, label_smoothing=0.0, loss_type="simpo",
                                accelerator=types.SimpleNamespace(device="cpu"))
    losses, chosen, rejected = CPOTrainer.cpo_loss(cpo, *average.chunk(2))
    theirs = {"rewards/chosen": chosen.mean().item(), "rewards/rejected": rejected.mean().item(),
              "rewards/accuracies": (chosen > rejected).float().mean().item(),
              "rewards/margins": (chosen - rejected).mean().item(),
              "logps/chosen": average.chunk(2)[0].mean().item(), "logps/rejected": average.chunk(2)[1].mean().item()}
    d = max([abs(mine - losses.mean().item())] + [abs(mine_metrics[k] - theirs[k]) for k in pl.METRICS])
    print(f"{'simpo':12s} loss {mine:.6f} (TRL {losses.mean().item():.6f})  max |d| over loss and 6 metrics {d:.2e}")
    worst = max(worst, d)
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
