"""Ulysses against the unsplit forward on a 2-rank gloo group: for a tiny Llama (4 heads, 2 key/value heads: split
by heads) and a tiny Qwen3 (4 heads, 1 key/value head: replicated), each loss path (full, chunked), packed rows
and rows of an odd length (padded to the sequence group), and a layer recomputed under activation checkpointing:
the summed loss of the two slices and the sum of the two ranks' gradients next to the whole rows' loss and
gradients, all on the same model. Rank 0 writes JSON {case: {"loss": [whole, split], "grad_rel": max relative
difference}}.  Usage: torchrun --nproc_per_node=2 ulysses_grads.py OUT.json"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

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


def loss_and_grads(model, token_loss: TokenLoss, batch: dict) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = token_loss.loss_sum(model, batch)
    loss.backward()
    value = loss.detach().clone()
    grads = [p.grad.clone() for p in model.parameters()]
    if token_loss.sp_group is not None:  # each rank's part: the sum over the group is the whole rows'
        dist.all_reduce(value)
        for g in grads:
            dist.all_reduce(g)
    return value.item(), grads


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
    for impl, length, packed in cases + [("chunked", 64, "recompute")]:
        if packed == "recompute":
            apply_activation_checkpointing(model)
        batch = rows(length, packed is not False)
        whole = loss_and_grads(model, TokenLoss(impl, model, torch.device("cpu")), batch)
        split = loss_and_grads(model, TokenLoss(impl, model, torch.device("cpu"), sp_group=group), batch)
        rel = max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(whole[1], split[1]))
        kind = "recompute" if packed == "recompute" else "packed" if packed else "padded"
        results[f"{family}/{impl}/{kind}/{length}"] = {"loss": [whole[0], split[0]], "grad_rel": rel}
if dist.get_rank() == 0:
    Path(sys.argv[1]).write_text(json.dumps(results, indent=1))
dist.destroy_process_group()
