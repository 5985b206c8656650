"""Each strategy's clip_grad_norm (llmtrain.parallelize.STRATEGIES) on a small MLP in a 2-rank gloo group: each
rank backpropagates half of one batch; the norm returned (before clipping) and the norm after clipping to half
of it, as every rank sees them, next to the unsharded model's norm on the whole batch. fsdp2 runs twice: one
layout for every gradient (the local-shard all-reduce path) and a mixed one (weights sharded on dim 1, biases on
dim 0: DTensor's own norm). Rank 0 writes JSON.  Usage: torchrun --nproc_per_node=2 clip_norms.py OUT.json"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from llmtrain.parallelize import STRATEGIES


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def backward(model: nn.Module, rows: slice) -> None:
    torch.manual_seed(1)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    ((model(x[rows]) - y[rows]) ** 2).mean().backward()


def full_grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]


def wrap(kind: str, model: nn.Module) -> nn.Module:
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if kind == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=True,
                                        device_id=torch.device("cpu"))
    from torch.distributed.fsdp import fully_shard

    placement = (lambda p: Shard(p.ndim - 1)) if kind == "fsdp2_mixed" else None
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, shard_placement_fn=placement)
    return fully_shard(model)


dist.init_process_group("gloo")
rank = dist.get_rank()
whole = mlp()
backward(whole, slice(0, 8))
ref = torch.nn.utils.get_total_norm([p.grad for p in whole.parameters()]).item()
ref_grads = [p.grad for p in whole.parameters()]
results = {"reference": ref}
for kind in ("ddp", "fsdp", "fsdp2", "fsdp2_mixed"):
    strategy = STRATEGIES[kind.split("_")[0]]
    model = wrap(kind, mlp())
    backward(model, slice(4 * rank, 4 * rank + 4))
    layouts = {(p.grad.device_mesh, p.grad.placements) for p in model.parameters() if isinstance(p.grad, DTensor)}
    before = strategy.clip_grad_norm(model, ref / 2).item()
    after = strategy.clip_grad_norm(model, 0).item()  # max_norm 0: the norm only, nothing clipped
    got = {"before": before, "after": after, "dtensor_layouts": len(layouts)}
    if kind != "fsdp":  # FSDP1's parameters hold local shards of flat parameters: compared through the norms only
        got["grad_diff"] = max((g - r * (ref / 2) / (ref + 1e-6)).abs().max().item()
                               for g, r in zip(full_grads(model), ref_grads))
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, got)
    results[kind] = ranks
if rank == 0:
    Path(sys.argv[1]).write_text(json.dumps(results, indent=1))
dist.destroy_process_group()
