"""llmtrain's KTO (recipes/kto.py, llmtrain.losses.kto) against TRL's KTOTrainer on the same models and unpaired
rows: the tokenized rows and KL rows, the loss, the metrics and the gradient of every parameter.

TRL is a dev-only comparison, kept out of llmtrain's environment; run this with a Python that has trl installed
(TRL 1.16 was checked; `python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 trl==1.16.0`), from
the repo root:

    PYTHONPATH=. .venv-trl/bin/python tests/scripts/trl_kto_parity.py

Eight demo rows (data/demo/unpaired.jsonl, desirable and undesirable mixed) go through KTOTrainer's own
tokenization, KL completions (its rotation within a batch), collator and compute_loss on one batch of 8 with a
reference model of other weights; llmtrain's side encodes the same records (llmtrain.data.unpaired), rotates and
collates them as recipes/kto.py does with a global batch of 8, and scores them with the same two models (seeded
so that the KL point is above its clamp at 0) through
llmtrain.losses.kto, the KL point included (one micro-batch on one rank: the step's mean is TRL's batch mean).
Cases: kto, kto with unequal desirable / undesirable weights, apo_zero_unpaired. Prints one line per case with the
largest |difference| of the loss and gradients (and of the metrics, relative) and exits non-zero above 1e-6."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from trl import KTOConfig, KTOTrainer

from llmtrain.config import DataConfig
from llmtrain.data.formats import UNPAIRED
from llmtrain.data.unpaired import collate_unpaired, encode_unpaired, with_kl_completions
from llmtrain.losses import kto as kl_lib
from llmtrain.losses.preference import sequence_logps
from llmtrain.losses.token import token_logps

REPO = Path(__file__).resolve().parents[2]
ROWS = [0, 1004, 1, 2, 1005, 1006, 3, 1007]  # lines of unpaired.jsonl: desirable (< 1000) and undesirable, mixed
SEQ_LEN = 256
TOL = 1e-6
# name: (loss_type, beta, desirable_weight, undesirable_weight)
CASES = {"kto": ("kto", 0.1, 1.0, 1.0), "kto weighted": ("kto", 0.5, 1.33, 0.75),
         "apo_zero_unpaired": ("apo_zero_unpaired", 0.2, 1.0, 1.0)}


def tiny(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))


def grads(model) -> list[torch.Tensor]:
    """Every parameter's gradient (then cleared, for the other side's backward)."""
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out


def rows_of(ids: torch.Tensor, attention: torch.Tensor, completion: torch.Tensor) -> list[tuple[list, list]]:
    """TRL's padded rows -> each row's (prompt ids, completion ids)."""
    out = []
    for i, a, c in zip(ids.tolist(), attention.tolist(), completion.tolist()):
        real = [(t, m) for t, n, m in zip(i, a, c) if n]
        out.append(([t for t, m in real if not m], [t for t, m in real if m]))
    return out


def ours(records, tok, policy, ref, loss_type, beta, wd, wu) -> tuple[dict, float, dict]:
    """llmtrain's batch, loss (backward run on policy) and metrics."""
    encoded = [UNPAIRED.columns(encode_unpaired(r, DataConfig(seq_len=SEQ_LEN), tok), None, None) for r in records]
    stored = with_kl_completions(Dataset.from_list(encoded), len(records), SEQ_LEN).with_format("torch")
    batch = collate_unpaired([stored[i] for i in range(len(records))], tok.pad_token_id)

    def logps(model, kl=False):
        prefix = "kl_" if kl else ""
        labels = batch[prefix + "labels"]
        logits = model(input_ids=batch[prefix + "input_ids"], position_ids=batch[prefix + "position_ids"]).logits
        return sequence_logps(token_logps(logits, labels), labels)[0]

    desirable = batch["label"]
    with torch.no_grad():
        ref_logps = logps(ref)
        summed = kl_lib.kl_sums(logps(policy, True), logps(ref, True))
    kl = kl_lib.kl_point(summed, torch.tensor(len(records)))
    sums = kl_lib.kto_sums(logps(policy), ref_logps, desirable, kl, beta, wd, wu, loss_type)
    loss = kl_lib.objective(sums, torch.tensor(float(len(records))))
    loss.backward()
    n = int(desirable.sum())
    metrics = kl_lib.metrics(sums.metrics, n, len(records) - n, kl.item() if kl_lib.uses_kl(loss_type) else 0.0)
    return batch, loss.item(), metrics


def main() -> int:
    tok = AutoTokenizer.from_pretrained(REPO / "assets" / "tokenizer")
    lines = (REPO / "data" / "demo" / "unpaired.jsonl").read_text().splitlines()
    records = [json.loads(lines[i]) for i in ROWS]
    worst_all = 0.0
    for name, (loss_type, beta, wd, wu) in CASES.items():
        with tempfile.TemporaryDirectory() as out:
            args = KTOConfig(output_dir=out, loss_type=loss_type, beta=beta, desirable_weight=wd,
                             undesirable_weight=wu, per_device_train_batch_size=len(records), report_to="none",
                             use_cpu=True, max_length=SEQ_LEN)
            trainer = KTOTrainer(model=tiny(1), ref_model=tiny(0), args=args, processing_class=tok,
                                 train_dataset=Dataset.from_list(records))
            inputs = next(iter(trainer.get_train_dataloader()))
            model = trainer.model
            model.train()
            theirs_loss = trainer.compute_loss(model, inputs)
            theirs_loss.backward()
            theirs_grads = grads(model)
            theirs = {k: v[-1] for k, v in trainer._metrics["train"].items()}

            batch, loss, metrics = ours(records, tok, model, trainer.ref_model, loss_type, beta, wd, wu)
            ours_grads = grads(model)
        # The same tokens: rows and KL rows (TRL's KL rows exist only for the kto loss).
        sides = [("", "input_ids", "attention_mask", "completion_mask")]
        if kl_lib.uses_kl(loss_type):
            sides.append(("kl_", "KL_input_ids", "KL_attention_mask", "KL_completion_mask"))
        for prefix, ids, attention, completion in sides:
            labels = batch[prefix + "labels"]
            mine = [([t for t, lab in zip(r, lr) if lab == -100 and t != tok.pad_token_id],
                     [t for t, lab in zip(r, lr) if lab != -100])
                    for r, lr in zip(batch[prefix + "input_ids"].tolist(), labels.tolist())]
            if mine != rows_of(inputs[ids], inputs[attention], inputs[completion]):
                print(f"{name}: the {prefix or 'matched '}rows differ from TRL's")
                return 1
        loss_diff = abs(loss - theirs_loss.item())
        grad_diff = max((a - b).abs().max().item() for a, b in zip(ours_grads, theirs_grads))
        names = [k for k in metrics if k in theirs]
        metric_diff = max(abs(metrics[k] - theirs[k]) / max(1.0, abs(theirs[k])) for k in names)
        worst = max(loss_diff, grad_diff, metric_diff)
        worst_all = max(worst_all, worst)
        print(f"{name}: loss {loss:.8f} (TRL {theirs_loss.item():.8f}) |diff| {loss_diff:.1e}, gradients "
              f"max |diff| {grad_diff:.1e}, metrics {', '.join(names)} max rel diff {metric_diff:.1e}, kl "
              f"{metrics['kl']:.6f} (TRL {theirs['kl']:.6f})")
        if kl_lib.uses_kl(loss_type) and not metrics["kl"] > 0:  # these seeds put the KL point above its clamp
            print(f"{name}: the KL point is {metrics['kl']}, so its path is not compared")
            return 1
        if {"rewards/chosen", "rewards/rejected", "kl"} - set(names):
            print(f"{name}: a metric is missing from one side: ours {sorted(metrics)}, TRL's {sorted(theirs)}")
            return 1
    print(f"largest difference {worst_all:.1e} (tolerance {TOL:g})")
    return 0 if worst_all <= TOL else 1


if __name__ == "__main__":
    sys.exit(main())
