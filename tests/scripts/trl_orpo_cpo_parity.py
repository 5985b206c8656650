"""llmtrain's ORPO and CPO (dpo.loss=orpo | cpo) against TRL's ORPOTrainer and CPOTrainer on the same model and
pairs: loss, metrics and the gradient of every parameter.

TRL is a dev-only comparison, kept out of llmtrain's environment; run this with a Python that has trl installed
(TRL 1.16 was checked; `python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 trl==1.16.0`), from
the repo root:

    PYTHONPATH=. .venv-trl/bin/python tests/scripts/trl_orpo_cpo_parity.py

The pairs are llmtrain's collated demo pairs (llmtrain.data.preference), handed to the trainers' own
get_batch_loss_metrics in TRL's batch layout (chosen_* / rejected_* input ids, attention mask and labels with the
prompt at -100): TRL's concatenated forward, log-probs (summed or averaged), NLL, loss and metrics, on the trainer's
own model, which llmtrain's path runs too. TRL logs nll_loss 0 when cpo_alpha is 0 (it skips the term); llmtrain
logs the NLL it would have. Prints one line per case with the largest |difference| and exits non-zero above 1e-6."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from trl.experimental.cpo import CPOConfig, CPOTrainer
from trl.experimental.orpo import ORPOConfig, ORPOTrainer

from llmtrain.config import DataConfig
from llmtrain.data.preference import collate_pairs, encode_preference
from llmtrain.losses import preference as pl

REPO = Path(__file__).resolve().parents[2]
PAIRS = 8
TOL = 1e-6
# name: (loss, cpo_loss_type, beta, label_smoothing, gamma, cpo_alpha)
CASES = {"orpo": ("orpo", "sigmoid", 0.5, 0.0, 0.0, 1.0), "cpo sigmoid": ("cpo", "sigmoid", 0.1, 0.1, 0.0, 1.0),
         "cpo hinge": ("cpo", "hinge", 0.2, 0.0, 0.0, 0.5), "cpo ipo": ("cpo", "ipo", 0.3, 0.0, 0.0, 1.0),
         "cpo simpo": ("cpo", "simpo", 2.0, 0.1, 0.5, 0.5)}


def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))


def trainer(name: str, records, tok, out: str):
    loss, cpo_type, beta, eps, gamma, alpha = CASES[name]
    common = dict(output_dir=out, beta=beta, report_to="none", use_cpu=True, per_device_train_batch_size=PAIRS)
    if loss == "orpo":
        return ORPOTrainer(model=tiny(), args=ORPOConfig(**common), processing_class=tok,
                           train_dataset=Dataset.from_list(records))
    args = CPOConfig(**common, loss_type=cpo_type, label_smoothing=eps, simpo_gamma=gamma, cpo_alpha=alpha)
    return CPOTrainer(model=tiny(), args=args, processing_class=tok, train_dataset=Dataset.from_list(records))


def grads(model) -> list[torch.Tensor]:
    """Every parameter's gradient (then cleared, for the other side's backward)."""
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out


def demo_pairs(pairs: int = PAIRS):
    """The tokenizer, the first `pairs` demo records and llmtrain's collated batch of them."""
    tok = AutoTokenizer.from_pretrained(REPO / "assets" / "tokenizer")
    records = [json.loads(line) for line in (REPO / "data" / "demo" / "preference.jsonl").open()][:pairs]
    return tok, records, collate_pairs([encode_preference(r, DataConfig(seq_len=128), tok) for r in records],
                                       tok.pad_token_id)


def main() -> int:
    tok, records, batch = demo_pairs()
    ids, labels = batch["input_ids"], batch["labels"]
    # Right padding: a row's tokens are those up to its response's last (ORPO's NLL covers them all).
    at = torch.arange(ids.shape[1])
    mask = (at <= torch.where(labels != -100, at, -1).amax(1, keepdim=True)).long()
    theirs_batch = {f"{side}_{key}": value[rows] for side, rows in (("chosen", slice(0, PAIRS)),
                                                                     ("rejected", slice(PAIRS, None)))
                    for key, value in (("input_ids", ids), ("attention_mask", mask), ("labels", labels))}
    worst = 0.0
    for name, (loss, cpo_type, beta, eps, gamma, alpha) in CASES.items():
        with tempfile.TemporaryDirectory() as out:
            t = trainer(name, records, tok, out)
            model = t.model.float().train()
            theirs, their_metrics = t.get_batch_loss_metrics(model, theirs_batch)
            theirs.backward()
            their_grads = grads(model)
            logits = model(input_ids=ids, position_ids=batch["position_ids"]).logits
            scored = pl.scored_labels(loss, batch)
            logps, lengths, nll = pl.response_logps(pl.token_logps(logits, scored), scored, labels)
            sums = pl.preference_sums(logps, lengths, None, loss, beta, eps, gamma, cpo_type, nll)
            counts = pl.pair_counts(scored)
            mine = pl.objective(sums, counts, pl.nll_weight(loss, 0.0, alpha))
            mine.backward()
            my_grads = grads(model)
        mine_metrics = pl.metrics(sums.metrics, PAIRS, loss, int(counts[1]))
        if alpha == 0:
            mine_metrics["nll_loss"] = 0.0
        worst = max(worst, compare(name, mine, theirs, mine_metrics, their_metrics, my_grads, their_grads))
    return 0 if worst < TOL else 1


def compare(name: str, mine, theirs, mine_metrics: dict, their_metrics: dict, my_grads, their_grads) -> float:
    """Prints the case's largest differences and returns the largest: the loss, each metric (relative to 1 or
    more: logps/* are summed log-probs near -80, where fp32 steps by 8e-6) and every gradient."""
    d_loss = abs(mine.item() - theirs.item())
    d_metrics = max(abs(v - their_metrics[k]) / max(1.0, abs(v)) for k, v in mine_metrics.items())
    d_grad = max((a - b).abs().max().item() for a, b in zip(my_grads, their_grads))
    scale = max(b.abs().max().item() for b in their_grads)
    print(f"{name:15s} loss {mine.item():.6f} (TRL {theirs.item():.6f}) |d| loss {d_loss:.1e}, "
          f"{len(mine_metrics)} metrics {d_metrics:.1e} (relative), gradients {d_grad:.1e} (largest {scale:.1e})")
    return max(d_loss, d_metrics, d_grad)


if __name__ == "__main__":
    sys.exit(main())
