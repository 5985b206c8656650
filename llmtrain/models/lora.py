"""LoRA with PEFT: adapters injected into the meta model before parallelizing (so every strategy wraps
them like any other parameter), their seeded init, the base fingerprint that checkpoints record, and the
merge math the exports use (llmtrain.export writes output_dir/adapter and the merged output_dir/hf).
Parameter names: llmtrain.models.names."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import zlib
from pathlib import Path

import torch
from torch import nn

from llmtrain.config import ConfigError, LoraConfig
from llmtrain.models import vision
from llmtrain.models.dropout import KeyedDropout
from llmtrain.models.names import ADAPTER, base_name, clean_name, is_adapter, is_trained_copy, peft_key
from llmtrain.utils import hash_sampled

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_config(section: LoraConfig):
    import peft

    return peft.LoraConfig(r=section.r, lora_alpha=section.alpha, lora_dropout=section.dropout,
                           target_modules=section.target_modules, modules_to_save=section.modules_to_save or None)


def _matches(name: str, key: str) -> bool:
    return name == key or name.endswith("." + key)


def apply(model: nn.Module, section: LoraConfig, frozen_parts: list[str] = ()) -> nn.Module:
    """Inject the adapters into the meta model (in place; the class stays the transformers one) and freeze
    the base. Names that match nothing are a ConfigError listing what exists. A vision-language model's
    adapters go on the linear layers of the parts that train, those not in `frozen_parts` (model.freeze)."""
    import peft

    names = [n for n, _ in model.named_modules()]
    within = vision.adaptable(model, frozen_parts) if vision.wraps_vision(model) else \
        [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    linear = sorted({n.rsplit(".", 1)[-1] for n in within})
    if isinstance(section.target_modules, list):
        lost = [k for k in section.target_modules if not any(_matches(n, k) for n in within)]
        if lost:
            raise ConfigError(f"lora.target_modules: {lost} match no linear layer of the model"
                              f"{' outside model.freeze' if vision.wraps_vision(model) else ''}; "
                              f"its linear layers are {linear} (or all-linear)")
    lost = [k for k in section.modules_to_save if not any(_matches(n, k) for n in names)]
    if lost:
        raise ConfigError(f"lora.modules_to_save: {lost} match no module of the model "
                          f"(e.g. {[n for n in names if n.count('.') < 2 and n][:8]})")
    tied = _tied_embeddings(model)
    if hit := [k for k in section.modules_to_save if any(_matches(n, k) for n in tied)]:
        # PEFT (0.21) ties the trained copies only with ensure_weight_tying, and transformers' tie_weights (needed
        # after materializing) then fails (KeyError); without it, tie_weights ties lm_head to the trained copy and
        # the adapter export failed after training (measured). Refuse before any work instead.
        raise ConfigError(f"lora.modules_to_save: {hit} is tied: {' and '.join(tied)} share one weight "
                          "(tie_word_embeddings=true), which a trained copy would untie; leave it out, or untie the "
                          "base first (save it with tie_word_embeddings=false and its own lm_head.weight) and list "
                          "both embeddings")
    config = peft_config(section)
    if vision.wraps_vision(model):  # by full name: PEFT's all-linear would adapt the vision tower too
        config.target_modules = [n for n in within if section.target_modules == "all-linear"
                                 or any(_matches(n, k) for k in section.target_modules)]
    model = peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    keyed_dropout(model)
    if section.base_dtype == "bf16":
        cast = {}  # by parameter: tied embeddings stay one tensor
        for module in model.modules():  # frozen tensors only: adapters and their optimizer state stay fp32
            for name, p in module.named_parameters(recurse=False):
                if not p.requires_grad:
                    new = cast.setdefault(p, nn.Parameter(p.to(torch.bfloat16), requires_grad=False))
                    setattr(module, name, new)
    return model


def keyed_dropout(model: nn.Module) -> None:
    """PEFT's adapter dropout (nn.Dropout; nn.Identity at lora.dropout=0, left as it is) -> KeyedDropout, each
    told apart by its module's name: masks keyed by (seed, step, sample, layer), see llmtrain.models.dropout.
    No parameter or buffer changes, so the adapter and merged exports are what they were."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Dropout) and ".lora_dropout." in f".{name}.":
            parent, _, child = name.rpartition(".")
            model.get_submodule(parent)[child] = KeyedDropout(module.p, zlib.crc32(clean_name(name).encode()))


def _tied_embeddings(model: nn.Module) -> list[str]:
    """The input and output embedding modules' names when they share one weight, else []."""
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if out is None or inp.weight is not out.weight:
        return []
    return [n for n, m in model.named_modules() if m is inp or m is out]


def prepare(model: nn.Module, section: LoraConfig, seed: int,
            frozen_parts: list[str] = ()) -> tuple[nn.Module, dict[str, torch.Tensor] | None]:
    """The meta model with adapters injected and their initial values ({name: full tensor}), or the model
    unchanged and None when lora.enabled is off. frozen_parts: apply's."""
    if not section.enabled:
        return model, None
    model = apply(model, section, frozen_parts)
    return model, initial_adapters(model, section, seed)


def check(section: LoraConfig) -> None:
    """Set-up checks: lora.init_from is a fitting PEFT adapter (the checkpoint to resume is checked against
    the base by check_resume, once it is chosen)."""
    if section.enabled:
        check_init_from(section)


def describe(model: nn.Module) -> str:
    """`trainable 6.8M of 1.24B (0.55%)`, counted on the meta model (tied weights once)."""
    params = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return f"trainable {_human(trainable)} of {_human(total)} ({100 * trainable / total:.2f}%)"


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'B' else 1}f}{unit}"
    return str(n)


def initial_adapters(model: nn.Module, section: LoraConfig, seed: int) -> dict[str, torch.Tensor]:
    """{parameter name: full CPU tensor} for the adapters (and, from init_from, modules_to_save copies),
    computed alike on every rank: the same init for any world size and strategy. PEFT's default init:
    lora_A kaiming-uniform (each from its own generator seeded by seed and name), lora_B zero, so the model
    starts as the base. Fresh modules_to_save copies start as the base (the loader copies them)."""
    wanted = {clean_name(n): p for n, p in model.named_parameters() if p.requires_grad}
    if section.init_from is not None:
        return _read_adapter(Path(section.init_from), wanted, section)
    out = {}
    for name, p in wanted.items():
        if not is_adapter(name):
            continue
        t = torch.zeros(p.shape, dtype=torch.float32)
        if ".lora_A." in name:
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)
        out[name] = t
    return out


def check_init_from(section: LoraConfig) -> None:
    """Before any process group: the directory holds a PEFT LoRA adapter with this rank and alpha."""
    if section.init_from is None:
        return
    path = Path(section.init_from)
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(f"lora.init_from: {path} is not a PEFT adapter directory "
                          f"(needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    saved = json.loads((path / ADAPTER_CONFIG).read_text())
    for key, ours in (("r", section.r), ("lora_alpha", section.alpha)):
        if saved.get(key) != ours:
            raise ConfigError(f"lora.init_from: {path} has {key}={saved.get(key)} but lora."
                              f"{'r' if key == 'r' else 'alpha'}={ours}; set it to match the adapter")


def _read_adapter(path: Path, wanted: dict[str, nn.Parameter], section: LoraConfig) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    saved = load_file(path / ADAPTER_WEIGHTS)
    by_key = {peft_key(n): n for n in wanted}
    missing = sorted(set(by_key) - set(saved))
    unexpected = sorted(set(saved) - set(by_key))
    if missing or unexpected:
        raise ConfigError(f"lora.init_from: {path} does not fit lora.target_modules/modules_to_save: "
                          f"missing {missing[:4]} ({len(missing)}), unexpected {unexpected[:4]} ({len(unexpected)})")
    out = {}
    for key, name in by_key.items():
        if saved[key].shape != wanted[name].shape:
            raise ConfigError(f"lora.init_from: {key} has shape {tuple(saved[key].shape)}, the model needs "
                              f"{tuple(wanted[name].shape)} (lora.r={section.r})")
        out[name] = saved[key].float()
    return out


def fingerprint(model_path: str | None, model_config: dict | None, seed: int, samples: int = 16) -> dict:
    """What a LoRA checkpoint's base was: model.path and a hash of its safetensors headers, sizes and weights
    (of a file above 64 MiB, 16 1-MiB blocks spread over it: two fine-tunes of one architecture share the
    headers but not the bytes), or of the inline config and seed that made a random base."""
    h = hashlib.sha256()
    if model_path is not None:
        for f in sorted(Path(model_path).glob("*.safetensors")):
            size = f.stat().st_size
            with f.open("rb") as fh:
                header = 8 + int.from_bytes(fh.read(8), "little")
                fh.seek(0)
                h.update(f.name.encode() + size.to_bytes(8, "little") + fh.read(header))
                hash_sampled(h, fh, header, size, samples)
    else:
        h.update(json.dumps(model_config, sort_keys=True).encode() + str(seed).encode())
    return {"path": model_path, "fingerprint": h.hexdigest()[:16]}


def check_resume(checkpoint: Path, saved: dict, current: dict) -> None:
    """A LoRA checkpoint holds no base: it resumes only with LoRA on (`current`, the base's fingerprint(),
    is {} with LoRA off) and onto the base it was trained on (`saved`: the checkpoint's record, {} for a
    full model)."""
    if bool(saved) != bool(current):
        kind = "LoRA adapters only" if saved else "a full model"
        raise ConfigError(f"checkpoint.resume: {checkpoint} holds {kind}; set lora.enabled="
                          f"{'true' if saved else 'false'} or checkpoint.resume=never")
    if saved and saved["fingerprint"] != current["fingerprint"]:
        raise ConfigError(f"checkpoint.resume: {checkpoint} was trained on the base {saved['path']} "
                          f"(fingerprint {saved['fingerprint']}) but model.path is {current['path']} "
                          f"(fingerprint {current['fingerprint']}); resume onto the same base or use "
                          "checkpoint.resume=never")


def merged_state(state: dict[str, torch.Tensor], section: LoraConfig) -> dict[str, torch.Tensor]:
    """A full (gathered) state dict of the training model -> base names, adapters merged in."""
    base = {base_name(k): v for k, v in state.items() if not is_adapter(k) and not is_trained_copy(k)}
    return merge(base, {k: v for k, v in state.items() if is_adapter(k) or is_trained_copy(k)}, section)


def merge(base: dict[str, torch.Tensor], trained: dict[str, torch.Tensor], section: LoraConfig) -> dict:
    """Base weights (by their own names) + adapters (by ours) -> PEFT's merge_and_unload in fp32:
    W + alpha/r * B @ A, and modules_to_save copies in place of the originals."""
    out = {k: v.float() for k, v in base.items()}
    for name, t in trained.items():
        if f".modules_to_save.{ADAPTER}." in name:
            out[base_name(name)] = t.float()
        elif f".lora_A.{ADAPTER}." in name:
            b = trained[name.replace(".lora_A.", ".lora_B.")].float()
            target = base_name(name.replace(f".lora_A.{ADAPTER}.", ".base_layer."))
            out[target] = out[target] + (section.alpha / section.r) * (b @ t.float())
    return out


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The base model, for a forward inside the block: every adapter (and modules_to_save copy) switched off,
    as PEFT's PeftModel.disable_adapter does. The flag itself, not enable_adapters(): that also flips
    requires_grad, which FSDP forbids on wrapped parameters and which a no-grad reference forward needs not."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    layers = [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False
