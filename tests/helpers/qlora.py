"""The QLoRA model of tests/models/test_qlora.py and its workers (tests/scripts/qlora_ranks.py, qlora_memory.py): its
shapes, built as the recipes build it, stepped, and its dequantized base."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig

from llmtrain import parallelize
from llmtrain.config import LoraConfig, ModelConfig, ParallelConfig
from llmtrain.models import lora, nf4
from llmtrain.models.hf import build_meta_model, check_initialized
from llmtrain.models.names import clean_name

# hidden 256, MLP 704: q/o 256 x 256 (1024 blocks of 64, 4 scaler groups of 256), k/v 128 x 256 (2 groups),
# gate/up 704 x 256 and down 256 x 704 (2816 blocks: 11 groups, which 2 fsdp2 ranks cannot split: the fallback).
MODEL = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": True}
ODD = dict(MODEL, intermediate_size=705)
QLORA = LoraConfig(enabled=True, r=4, alpha=8.0, dropout=0.0, quantize_base="nf4")
SEED = 3


def model_config(shape: dict = MODEL) -> LlamaConfig:
    config = LlamaConfig(**shape)
    config._attn_implementation = "eager"
    config.use_cache = False
    return config


def build(strategy: str, section: LoraConfig, dtype: torch.dtype = torch.float32, shape: dict = MODEL):
    """The model as the recipes build it: meta -> LoRA -> parallelize -> load (random init, seeded) -> NaN
    check -> nf4. lora_B starts random (not PEFT's zero) so that the adapters' gradients depend on the base."""
    config = model_config(shape)
    model, adapters = lora.prepare(build_meta_model(config, ModelConfig()), section, SEED)
    g = torch.Generator().manual_seed(SEED)
    adapters = {n: torch.randn(t.shape, generator=g) * 0.1 if ".lora_B." in n else t for n, t in adapters.items()}
    plan = parallelize.Plan(parallelize.STRATEGIES[strategy], "test", dtype)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
    model = parallelize.parallelize(model, ParallelConfig(strategy=strategy, mixed_precision="fp32"
                                                          if dtype == torch.float32 else "bf16"),
                                    plan, mesh, torch.device("cpu"))
    plan.strategy.load(model, None, config, SEED, adapters)
    check_initialized(model)
    return model, nf4.quantize_(model, section)


def step(model, steps: int = 2) -> dict:
    """Forward and backward on one fixed batch (the same on every rank), then an AdamW step and again:
    the losses, the first forward's logits, the adapters' first gradients (gathered) and the type of a
    base weight inside its layer's forward (fsdp2: what the all-gather made)."""
    ids = torch.randint(0, MODEL["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(SEED))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    out = {"losses": []}
    layer = next(m for n, m in model.named_modules() if n.endswith("layers.0.mlp.down_proj.base_layer"))
    layer.register_forward_pre_hook(lambda m, args: out.update(weight_in_forward=type(m.weight).__name__))
    for i in range(steps):
        result = model(input_ids=ids, labels=ids)
        result.loss.backward()
        out["losses"].append(result.loss.item())
        if i == 0:
            out["logits"] = result.logits.detach()
            out["grads"] = {clean_name(n): full(p.grad) for n, p in model.named_parameters() if p.requires_grad}
        opt.step()
        opt.zero_grad()
    return out


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def dequantized_base(model) -> dict[str, torch.Tensor]:
    """{name: the dequantized full weight} of every quantized weight."""
    return {clean_name(n): full(nf4.dequantized(p)) for n, p in model.named_parameters() if nf4.is_nf4(p)}



# 51M parameters, 50M of them in the blocks' linear weights (200 MB in fp32, 26 MB as NF4)
BIG = dict(MODEL, hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=8,
           num_hidden_layers=4)
