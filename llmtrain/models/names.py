"""Parameter names, one leaf for every translation between them: the segments wrappers insert (DDP, FSDP1,
activation checkpointing, compile), PEFT's in-place LoRA names inside the training model, the base model's
tensor names, and the keys of PEFT's adapter files.

Inside the training model (`inject_adapter_in_model` keeps the transformers class): `X.base_layer.weight`,
`X.lora_A.default.weight`, and for modules_to_save `X.original_module.weight` +
`X.modules_to_save.default.weight`. PEFT's files name the same tensors `base_model.model.X.lora_A.weight` and
`base_model.model.X.weight` (peft_key)."""

from __future__ import annotations

import re

ADAPTER = "default"  # PEFT's adapter name; its files leave it out
PEFT_PREFIX = "base_model.model."
WRAPPER_PARTS = re.compile(r"(^|\.)(module|_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)(?=\.)")
_PEFT_PARTS = re.compile(rf"\.(base_layer|original_module|modules_to_save\.{ADAPTER})(?=\.)")
_OURS = re.compile(rf"\.(lora_[AB])\.{ADAPTER}\.|\.modules_to_save\.{ADAPTER}\.")


def clean_name(name: str) -> str:
    """A parameter name without the segments DDP, FSDP1, checkpointing or compile insert."""
    return WRAPPER_PARTS.sub("", name).lstrip(".")


def base_name(name: str) -> str:
    """The base model's tensor name for one of our parameters (modules_to_save copies included)."""
    return _PEFT_PARTS.sub("", name)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def is_trained_copy(name: str) -> bool:
    """A modules_to_save copy (trained in place of its original)."""
    return ".modules_to_save." in name


def peft_key(name: str) -> str:
    """Our parameter name -> the key in PEFT's adapter_model.safetensors."""
    return PEFT_PREFIX + _OURS.sub(lambda m: f".{m.group(1)}." if m.group(1) else ".", name)
