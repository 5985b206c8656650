"""Saved state. Consolidated Hugging Face export: rank 0 receives the full state dict on CPU tensor by
tensor and writes safetensors + config + tokenizer into a temporary directory, published by rename."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from llmtrain.model import WEIGHTS_FILE, WEIGHTS_INDEX

MAX_SHARD_SIZE = "5GB"


def full_state_dict(model: nn.Module, strategy: str, device: torch.device) -> dict[str, torch.Tensor]:
    """Every rank must call this (it gathers shards); the tensors are on rank 0's CPU.
    FSDP1 with cpu_offload on CPU segfaults rank 0 (torch 2.13), so there every rank keeps a copy."""
    offload = not (strategy == "fsdp" and device.type == "cpu")
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
    return {k: v.detach().cpu() for k, v in state.items()} if dist.get_rank() == 0 else {}


def publish(tmp: Path, final: Path) -> None:
    """Replace `final` by the complete `tmp`: a reader sees the old or the new directory, never half."""
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def write_hf(state: dict[str, torch.Tensor], out: Path, config, tokenizer, dtype: torch.dtype) -> None:
    """A directory that transformers' from_pretrained loads with no llmtrain import. Never pickles."""
    import json

    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = {k: v.to(dtype).contiguous() for k, v in state.items()}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    split = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=MAX_SHARD_SIZE)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n] for n in names}, tmp / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": split.tensor_to_filename}
        (tmp / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2))
    else:
        assert (tmp / WEIGHTS_FILE).is_file()
    config = config.__class__.from_dict(config.to_dict())  # a copy: the live config stays as trained
    config.dtype = dtype
    config.use_cache = True
    config.save_pretrained(tmp)
    GenerationConfig.from_model_config(config).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    publish(tmp, out)


def export_hf(model: nn.Module, strategy: str, device: torch.device, out: str | Path, config, tokenizer,
              dtype: torch.dtype = torch.float32) -> None:
    """Collective: all ranks gather, rank 0 writes, all ranks wait until the export is complete."""
    state = full_state_dict(model, strategy, device)
    if dist.get_rank() == 0:
        write_hf(state, Path(out), config, tokenizer, dtype)
    dist.barrier()
