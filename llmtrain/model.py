"""Models and tokenizers from transformers: config, meta-device construction, weight loading that
does not multiply host RAM by the number of ranks, and recomputation of non-persistent buffers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PretrainedConfig

from llmtrain.config import ConfigError, ModelConfig

WEIGHTS_INDEX = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"


def check_paths(section: ModelConfig, tokenizer_path: str | None) -> None:
    """Fail before any process group exists when a named local directory is missing."""
    for key, path in (("model.path", section.path), ("tokenizer.path", tokenizer_path)):
        if path is None:
            continue
        local = Path(path)
        looks_local = local.is_absolute() or path.startswith(".") or local.exists() or path.count("/") != 1
        if looks_local and not local.is_dir():
            raise ConfigError(f"{key}: no such directory: {path}")
    if section.path is not None and Path(section.path).is_dir():
        if not (Path(section.path) / "config.json").is_file():
            raise ConfigError(f"model.path: {section.path} has no config.json (not a Hugging Face model directory)")


def load_tokenizer(path: str, trust_remote_code: bool):
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.eos_token_id is None:
        raise ConfigError(f"tokenizer at {path} has no eos_token; set one in its tokenizer_config.json")
    if tok.pad_token_id is None:  # Llama tokenizers ship without one; padding is masked out anyway
        tok.pad_token = tok.eos_token
    return tok


def load_model_config(section: ModelConfig, tokenizer) -> PretrainedConfig:
    if section.path is not None:
        config = AutoConfig.from_pretrained(section.path, trust_remote_code=section.trust_remote_code)
    else:
        inline = dict(section.config)
        inline.setdefault("vocab_size", len(tokenizer))
        inline.setdefault("bos_token_id", tokenizer.bos_token_id)
        inline.setdefault("eos_token_id", tokenizer.eos_token_id)
        inline.setdefault("pad_token_id", tokenizer.pad_token_id)
        try:
            config = LlamaConfig(**inline)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"model.config: {e}") from None
    if config.vocab_size < len(tokenizer):
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                          f"{config.vocab_size}; use a matching tokenizer.path")
    config._attn_implementation = section.attn_implementation
    config.use_cache = False
    return config


def build_meta_model(config: PretrainedConfig, section: ModelConfig) -> nn.Module:
    """Structure only: no memory is allocated until the parallelized model is materialized."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, trust_remote_code=section.trust_remote_code, dtype=torch.float32,
            attn_implementation=section.attn_implementation)
    return model


def decoder_layer_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The repeated block classes to shard/checkpoint, from the model itself (not hard-coded to Llama)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    if found:
        return found
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"cannot find decoder layers in {type(model).__name__}")
    return {type(max(lists, key=len)[0])}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    classes = tuple(decoder_layer_classes(model))
    return [m for m in model.modules() if isinstance(m, classes)]


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / WEIGHTS_INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / WEIGHTS_FILE).is_file():
        files = [WEIGHTS_FILE]
    else:
        raise ConfigError(f"model.path: {path} has no {WEIGHTS_FILE} or {WEIGHTS_INDEX} (safetensors only; "
                          "pickled .bin weights are not loaded)")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(path / name))
    return state


def full_state_dict_rank0(model_section: ModelConfig, config: PretrainedConfig, seed: int) -> dict:
    """Rank 0's full weights: read from model.path, or a seeded random init for model.config.
    Other ranks return {} and receive only their shards in load_weights."""
    if dist.get_rank() != 0:
        return {}
    if model_section.path is not None:
        state = _read_safetensors(Path(model_section.path))
    else:
        torch.manual_seed(seed)
        state = AutoModelForCausalLM.from_config(config, dtype=torch.float32).state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # one tensor for both: loaded through the embedding
    expected = set(build_meta_model(config, model_section).state_dict()) - set(state)
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    if expected:
        raise ConfigError(f"model.path: weights missing for {sorted(expected)[:5]} "
                          f"({len(expected)} tensors); is this a {config.model_type} checkpoint?")
    return state


def load_weights(model: nn.Module, full_state: dict, device: torch.device) -> None:
    """Rank 0 holds the full state dict; every rank receives its part tensor by tensor."""
    set_model_state_dict(model, full_state,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False))
    init_buffers(model, device)


def init_buffers(model: nn.Module, device: torch.device) -> None:
    """`to_empty` leaves non-persistent buffers (RoPE inv_freq) as garbage and no checkpoint holds them:
    rebuild each module that owns such buffers from its config and copy them over."""
    for module in model.modules():
        if not module._non_persistent_buffers_set or not hasattr(module, "config"):
            continue
        with torch.device("cpu"):
            fresh = type(module)(module.config)
        for name in module._non_persistent_buffers_set:
            getattr(module, name).copy_(getattr(fresh, name).to(device))


def num_params(config: PretrainedConfig) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
