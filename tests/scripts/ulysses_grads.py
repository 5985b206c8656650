"""Ulysses against the unsplit forward on a 2-rank gloo group: for a tiny Llama (4 heads, 2 key/value heads: split
by heads) and a tiny Qwen3 (4 heads, 1 key/value head: replicated), each loss path (full, chunked), packed rows
and rows of an odd length (padded to the sequence group), and a layer recomputed under activation checkpointing:
the split's loss (the whole rows', on each rank: ulysses.whole) and the sum of the two ranks' gradients next to the
unsplit loss and gradients, all on the same model; the same for a loss made of the per-token log-probs
(TokenLoss.token_logps: the whole rows' on each rank), nonlinear in each row's sum and in each token's, as DPO's and
GRPO's losses are. Rank 0 writes JSON {case: {"loss": [whole, split], "grad_rel": max relative difference}}.
Usage: torchrun --nproc_per_node=2 ulysses_grads.py OUT.json"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from llmtrain.distributed import sequence_group
from llmtrain.losses.token import TokenLoss
from llmtrain.models import attention
from llmtrain.parallelize import apply_activation_checkpointing

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=96)
FAMILIES = {"llama": lambda: LlamaConfig(**SHAPE, num_key_value_heads=2),
            "qwen3": lambda: Qwen3Config(**SHAPE, num_key_value_heads=1, head_dim=32)}


def rows(length: int, packed: bool) -> dict:
    """Two rows: packed (three examples, the pads a segment of their own) or one example each, right-padded."""
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, length), generator=g)
    if packed:
        cuts = [[0, 20, 41, length - 5, length], [0, 33, length]]
    else:
        cuts = [[0, length - 7, length], [0, length - 2, length]]
    pos = torch.stack([torch.cat([torch.arange(b - a) for a, b in zip(c, c[1:])]) for c in cuts])
    labels = ids.clone()
    for r, c in enumerate(cuts):
        labels[r, c[-2]:] = -100   # the last piece: padding
        labels[r, c[:-1]] = -100   # each piece's first token predicts nothing before it
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def logps_loss(model, token_loss: TokenLoss, batch: dict) -> torch.Tensor:
    """Nonlinear in each row's summed log-prob (as DPO's) and in each token's (as GRPO's clipped ratio)."""
    flat = token_loss.token_logps(model, batch)
    keep = batch["labels"][:, 1:] != -100
    row_sums = flat.new_zeros(keep.shape).masked_scatter(keep, flat).sum(1)
    return -F.logsigmoid(row_sums / 50).sum() + flat.exp().clamp(max=0.5).sum()


def loss_and_grads(model, token_loss: TokenLoss, batch: dict, loss_of) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = loss_of(model, token_loss, batch)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    if token_loss.sp_group is not None:  # each rank's gradient is its slice's part: their sum is the whole rows'
        for g in grads:
            dist.all_reduce(g)
    return loss.item(), grads


dist.init_process_group("gloo")
torch.set_num_threads(1)
group = sequence_group(dist.get_rank(), dist.get_world_size(), 2)
results = {}
for family, make in FAMILIES.items():
    config = make()
    config._attn_implementation = attention.NAME
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()  # train mode: layers checkpoint only when training
    cases = [(impl, length, packed) for impl in ("full", "chunked") for length, packed in ((64, True), (63, False))]
    losses = {"": lambda model, token_loss, batch: token_loss.loss_sum(model, batch), "logps/": logps_loss}
    for impl, length, packed in cases + [("chunked", 64, "by_example"), ("chunked", 64, "recompute")]:
        # by_example: rows past LONG_ROWS positions are attended example by example (attention.segmented_sdpa)
        attention.LONG_ROWS = 32 if packed == "by_example" else 4096
        if packed == "recompute":
            apply_activation_checkpointing(model)
        batch = rows(length, packed is not False)
        for name, loss_of in losses.items():
            whole = loss_and_grads(model, TokenLoss(impl, model, torch.device("cpu")), batch, loss_of)
            split = loss_and_grads(model, TokenLoss(impl, model, torch.device("cpu"), sp_group=group), batch, loss_of)
            rel = max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(whole[1], split[1]))
            kind = packed if packed in ("recompute", "by_example") else "packed" if packed else "padded"
            results[f"{family}/{name}{impl}/{kind}/{length}"] = {"loss": [whole[0], split[0]], "grad_rel": rel}
if dist.get_rank() == 0:
    Path(sys.argv[1]).write_text(json.dumps(results, indent=1))
dist.destroy_process_group()
