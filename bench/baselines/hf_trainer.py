"""The comparison point of bench/run.py's "vs HF Trainer" benchmark: transformers.Trainer (accelerate
underneath) on the same chat data, tokenizer and tiny Llama config, padded per batch by its SFT
collator (DataCollatorForSeq2Seq), trained on the assistant tokens only, Trainer defaults otherwise.

    torchrun --standalone --nproc_per_node=2 bench/baselines/hf_trainer.py --config configs/demo.yaml \
        --data data/demo/chat.jsonl --steps 30 --warmup 10 --output-dir DIR --out result.json

From the config file it takes the model shape (model.config), tokenizer.path, data.seq_len (the
truncation length), train.micro_batch_size (per-device batch), lr, warmup, schedule, weight decay,
clipping and seed. Every rank counts, per optimizer step, the label positions that carry a loss
(trained tokens) and the padded tokens it pushed through; rank 0 times the steps (on_step_end).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
import torch.distributed as dist
import yaml
from datasets import load_dataset
from transformers import (AutoTokenizer, DataCollatorForSeq2Seq, LlamaConfig, LlamaForCausalLM, Trainer,
                          TrainerCallback, TrainingArguments)

IGNORE = -100


class Counting:
    """Mixin for a Trainer (or TRL's SFTTrainer) that counts what each micro-batch carries (nothing else
    changed)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_trained, self.step_tokens, self.step_real = 0, 0, 0

    def count(self, inputs: dict) -> tuple[int, int, int]:
        """(trained, pushed-through, real) tokens of one micro-batch."""
        labels = inputs["labels"]
        # Padded batches have an attention mask; packed (padding-free) ones have none: every position is real.
        real = int(inputs["attention_mask"].sum()) if "attention_mask" in inputs else labels.numel()
        return int((labels[:, 1:] != IGNORE).sum()), labels.numel(), real  # trained: what the shifted loss covers

    def training_step(self, model, inputs, num_items_in_batch=None):
        trained, tokens, real = self.count(inputs)
        self.step_trained += trained
        self.step_tokens += tokens
        self.step_real += real
        return super().training_step(model, inputs, num_items_in_batch)


class CountingTrainer(Counting, Trainer):
    pass


class StepClock(TrainerCallback):
    def __init__(self, trainer: CountingTrainer):
        self.trainer, self.times, self.trained, self.tokens, self.real = trainer, [], [], [], []

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        self.times.append(time.perf_counter())
        self.trained.append(t.step_trained)
        self.tokens.append(t.step_tokens)
        self.real.append(t.step_real)
        t.step_trained = t.step_tokens = t.step_real = 0


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", required=True)
    p.add_argument("--data", default="data/demo/chat.jsonl")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--out", required=True)
    return p.parse_args()


def load_tokenizer(cfg: dict):
    tok = AutoTokenizer.from_pretrained(cfg["tokenizer"]["path"])
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def build_model(cfg: dict, tok) -> LlamaForCausalLM:
    """The config's model.config (vocab_size: the tokenizer's unless set, as llmtrain does), seeded."""
    shape = dict(cfg["model"]["config"])
    shape.setdefault("vocab_size", len(tok))
    torch.manual_seed(cfg["train"].get("seed", 42))
    return LlamaForCausalLM(LlamaConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                        pad_token_id=tok.pad_token_id, use_cache=False, **shape))


def training_kwargs(cfg: dict, args: argparse.Namespace) -> dict:
    """TrainingArguments (or SFTConfig) settings that follow the llmtrain config."""
    train = cfg["train"]
    return dict(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=train["micro_batch_size"],
        gradient_accumulation_steps=train.get("grad_accum_steps", 1), learning_rate=float(train["lr"]),
        warmup_steps=train.get("warmup_steps", 0), lr_scheduler_type=train.get("lr_schedule", "cosine"),
        weight_decay=train.get("weight_decay", 0.0), max_grad_norm=train.get("max_grad_norm", 1.0),
        adam_beta1=0.9, adam_beta2=0.95, seed=train.get("seed", 42), logging_steps=max(1, args.steps // 4),
        save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(), ddp_backend="gloo" if not torch.cuda.is_available() else None)


def train_and_report(trainer, args: argparse.Namespace, extra: dict | None = None) -> None:
    """Train with a StepClock; rank 0 writes the counts, rates and peak RSS (max over ranks) to args.out."""
    clock = StepClock(trainer)
    trainer.add_callback(clock)
    trainer.train()

    counts = torch.tensor([clock.trained, clock.tokens, clock.real], dtype=torch.float64)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64)
    world = 1
    if dist.is_initialized():
        dist.all_reduce(counts)
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)
        world = dist.get_world_size()
    trained, tokens, real = counts.tolist()
    w = args.warmup
    seconds = clock.times[-1] - clock.times[w - 1]
    wrapped = trainer.model_wrapped
    if trainer.args.process_index == 0:
        result = {
            "useful_tokens_per_sec": sum(trained[w:]) / seconds,
            "padded_tokens_per_sec": sum(tokens[w:]) / seconds,
            "trained_tokens": sum(trained[w:]), "tokens": sum(tokens[w:]), "real_tokens": sum(real[w:]),
            "seconds": seconds, "steps": args.steps, "warmup": w, "world_size": world,
            "step_end_s": [t - clock.times[0] for t in clock.times], "step_trained_tokens": trained,
            "peak_rss_bytes": rss.item(),
            "wrapper": type(wrapped).__name__,
            "find_unused_parameters": getattr(wrapped, "find_unused_parameters", None),
            "distributed_type": str(trainer.accelerator.distributed_type),
            "backend": dist.get_backend() if dist.is_initialized() else None, **(extra or {}),
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
        print(json.dumps(result))


def main() -> None:
    args = parse_args(__doc__)
    cfg = yaml.safe_load(open(args.config))
    seq_len = cfg["data"]["seq_len"]
    tok = load_tokenizer(cfg)

    def encode(record):
        out = tok.apply_chat_template(record["messages"], tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True, truncation=True, max_length=seq_len)
        ids = list(out["input_ids"])
        labels = [t if m else IGNORE for t, m in zip(ids, out["assistant_masks"])]
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}

    ds = load_dataset("json", data_files=args.data, split="train")
    ds = ds.map(encode, remove_columns=ds.column_names)
    trainer = CountingTrainer(model=build_model(cfg, tok), args=TrainingArguments(**training_kwargs(cfg, args)),
                              train_dataset=ds, processing_class=tok,
                              data_collator=DataCollatorForSeq2Seq(tok, padding=True))
    train_and_report(trainer, args)


if __name__ == "__main__":
    main()
