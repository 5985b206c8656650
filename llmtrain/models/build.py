"""The one way a model is built, for the policy, a frozen copy next to it (a reference) or a teacher from
another path: on meta -> converters (LoRA) -> plan -> parallelize -> each rank loads its own slices -> a check
that every parameter was loaded -> NF4 for a QLoRA base. Recipes, bench/ and tests/ all call build_model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import PretrainedConfig

from llmtrain import distributed, optim, parallelize
from llmtrain.config import LoraConfig, ModelConfig, ParallelConfig
from llmtrain.models import hf, lora, nf4, vision


@dataclass
class BuiltModel:
    """A parallelized, loaded model and what was decided building it."""
    model: nn.Module
    plan: parallelize.Plan
    mesh: DeviceMesh
    config: PretrainedConfig
    n_params: int      # counted on the meta model (tied weights once)
    n_trained: int     # parameters with gradients (fewer than n_params with LoRA; 0 for a frozen copy)
    no_decay: set[str]  # parameter names without weight decay, read before wrapping
    params_line: str   # e.g. `trainable 6.8M of 1.24B (0.55%)`
    quantized: nf4.Report | None = None  # lora.quantize_base=nf4: what was quantized, for the log


def build_model(section: ModelConfig, config: PretrainedConfig, parallel: ParallelConfig, env: distributed.DistEnv,
                seed: int, lora_section: LoraConfig | None = None, *, load: bool = True,
                frozen_next_to: BuiltModel | None = None, frozen_dtype: torch.dtype | None = None) -> BuiltModel:
    """Build `section`'s model (config: hf.load_model_config's). lora_section (enabled): adapters injected on
    the meta model, so that every strategy wraps them with their layer. load=False leaves the weights empty
    (NaN) for a checkpoint to fill. frozen_next_to: a frozen copy (no gradients, eval mode) sharded on that
    model's mesh with its strategy's frozen variant (Strategy.frozen), computing in frozen_dtype (None: that
    model's compute dtype; a distillation teacher has its own)."""
    model = hf.build_meta_model(config, section)
    if vision.is_vision(config):
        vision.freeze(model, section.freeze)
    adapters = None
    if lora_section is not None:
        model, adapters = lora.prepare(model, lora_section, seed, section.freeze)
    if frozen_next_to is not None:
        model.requires_grad_(False)
    n_params, params_line = sum(p.numel() for p in model.parameters()), lora.describe(model)
    no_decay = optim.no_decay_names(model)
    n_trained, frozen_bytes = parallelize.trained_and_frozen(model)
    if frozen_next_to is None:
        plan = parallelize.resolve(parallel, n_trained, env.world_size, env.device, frozen_bytes)
        mesh = distributed.build_mesh(env, parallel.replicate)
    else:
        plan = dataclasses.replace(frozen_next_to.plan, strategy=frozen_next_to.plan.strategy.frozen(),
                                   dtype=frozen_dtype or frozen_next_to.plan.dtype)
        mesh = frozen_next_to.mesh
    model = parallelize.parallelize(model, parallel, plan, mesh, env.device)
    if load or frozen_bytes:  # a checkpoint holds the trained weights only: the frozen (a LoRA base, a frozen
        # vision tower) come from here
        plan.strategy.load(model, Path(section.path) if section.path is not None else None, config, seed, adapters)
        hf.check_initialized(model)  # before nf4, whose 4-bit weights it cannot read
    quantized = None
    if lora_section is not None and lora_section.quantize_base == "nf4":
        quantized = nf4.quantize_(model, lora_section)
    if frozen_next_to is not None:
        model.eval()
    return BuiltModel(model, plan, mesh, config, n_params, n_trained, no_decay, params_line, quantized)

