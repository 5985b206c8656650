"""The bare minimum, in the style of the PyTorch FSDP2 / DDP tutorials: no llmtrain import, no data
pipeline, no clipping, no metrics. The baseline of bench/run.py's framework-overhead benchmark.

    torchrun --standalone --nproc_per_node=2 bench/baselines/bare_loop.py --config configs/demo.yaml \
        --steps 40 --warmup 10 [--every 5] --out result.json [--strategy fsdp2|ddp] [--reward --length L]

From the config file it takes only the shape: model.config (inline Llama config; without a vocab_size,
the tokenizer's size, as llmtrain does), data.seq_len, train.micro_batch_size, train.lr,
train.seed and parallel.strategy. One fixed random token batch per rank is reused every step.
Timed on rank 0 between barriers: the steps after --warmup, and windows of --every steps.
With --reward it is the floor of bench/run.py's reward benchmark: a one-score sequence classifier on
micro-batch pairs of random rows of --length tokens (chosen rows, then rejected), the Bradley-Terry loss, a fused
AdamW (what both sides of that benchmark use).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import yaml
import torch.nn.functional as F
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--every", type=int, default=5, help="also time windows of this many steps (as log.every_steps)")
    p.add_argument("--strategy", choices=["fsdp2", "ddp"], default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--reward", action="store_true", help="a reward model on pairs (score head, Bradley-Terry loss)")
    p.add_argument("--length", type=int, default=None, help="tokens per row (default data.seq_len)")
    args = p.parse_args()
    cfg = yaml.safe_load(open(args.config))
    strategy = args.strategy or cfg.get("parallel", {}).get("strategy", "fsdp2")
    seq, micro = args.length or cfg["data"]["seq_len"], cfg["train"]["micro_batch_size"]
    lr, seed = float(cfg["train"].get("lr", 3e-4)), cfg["train"].get("seed", 42)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # As llmtrain: model.config's vocab_size if set, else the tokenizer's size.
    vocab = (cfg["model"]["config"].pop("vocab_size", None)
             or len(AutoTokenizer.from_pretrained(cfg["tokenizer"]["path"])))
    torch.manual_seed(seed)
    # the classifier reads each row's last non-pad token: pad is id 0, which the reward rows never hold
    head = {"num_labels": 1, "pad_token_id": 0} if args.reward else {}
    config = LlamaConfig(vocab_size=vocab, use_cache=False, **head, **cfg["model"]["config"])
    model = (LlamaForSequenceClassification if args.reward else LlamaForCausalLM)(config)
    if strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
    model.train()
    # the reward floor's AdamW is fused, as the recipes' and TRL's default (adamw_torch_fused) are
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=args.reward or None)
    rows = 2 * micro if args.reward else micro  # a pair is two rows
    batch = torch.randint(int(args.reward), vocab, (rows, seq), generator=torch.Generator().manual_seed(seed + rank))

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        if not args.reward:
            return model(input_ids=batch, labels=batch).loss
        scores = model(input_ids=batch).logits[:, 0]
        return -F.logsigmoid(scores[:micro] - scores[micro:]).mean()

    marks = []  # (step, time) at window boundaries after warm-up
    for step in range(args.steps):
        if step >= args.warmup and (step - args.warmup) % args.every == 0:
            dist.barrier()
            marks.append((step, time.perf_counter()))
        loss = loss_of(batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.barrier()
    marks.append((args.steps, time.perf_counter()))
    seconds = marks[-1][1] - marks[0][1]
    tokens = (args.steps - args.warmup) * micro * seq * world
    windows = [(b[0] - a[0]) * micro * seq * world / (b[1] - a[1]) for a, b in zip(marks, marks[1:])]
    if rank == 0:
        result = {"strategy": strategy, "tokens_per_sec": tokens / seconds, "window_tokens_per_sec": windows,
                  "tokens": tokens, "seconds": seconds, "steps": args.steps, "warmup": args.warmup, "world_size": world,
                  "seq_len": seq,
                  "micro_batch_size": micro, "last_loss": loss.item(),
                  "pairs_per_sec": (args.steps - args.warmup) * micro * world / seconds if args.reward else None}
        with open(args.out, "w") as f:
            json.dump(result, f)
        print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
