"""Vision-language models (AutoModelForImageTextToText): which families train here and where their parts are.

FAMILIES names, per model_type, the modules of its three parts as transformers 5 lays them out: the vision
tower, the projector that maps its features into the language model, and the language model. They decide what
model.freeze freezes and which modules become wrap units (vision blocks, the tower's other modules, the
projector, the decoder layers: each part in units of its own, so that a frozen tower never shares one with trained
weights).
A family missing here is refused at set-up with the list of those that are."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from torch import nn
from transformers import PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from llmtrain.config import ConfigError


@dataclass(frozen=True)
class Parts:
    """Module paths (from the ...ForConditionalGeneration) of one family's parts."""
    tower: str          # the vision encoder; the projector is excluded from it when it lives inside
    projector: str
    language: str
    blocks: str         # the vision tower's repeated blocks (a ModuleList)
    layers: str         # the language model's decoder layers (a ModuleList)


FAMILIES: dict[str, Parts] = {
    "llava": Parts("model.vision_tower", "model.multi_modal_projector", "model.language_model",
                   "model.vision_tower.encoder.layers", "model.language_model.layers"),
    "qwen2_5_vl": Parts("model.visual", "model.visual.merger", "model.language_model", "model.visual.blocks",
                        "model.language_model.layers"),
    "gemma3": Parts("model.vision_tower", "model.multi_modal_projector", "model.language_model",
                    "model.vision_tower.encoder.layers", "model.language_model.layers"),
    # SmolVLM is Idefics3's architecture under its own model_type (its processor needs torchvision).
    **dict.fromkeys(("idefics3", "smolvlm"), Parts("model.vision_model", "model.connector", "model.text_model",
                                                   "model.vision_model.encoder.layers", "model.text_model.layers")),
}
# model.freeze's choices: the parts a user may freeze.
PART_NAMES = ("vision_tower", "projector", "language_model")


def is_vision_type(model_type: str | None) -> bool:
    """A model_type transformers builds with AutoModelForImageTextToText."""
    return model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def is_vision(config) -> bool:
    return is_vision_type(getattr(config, "model_type", None))


def transformers_model(model: nn.Module) -> PreTrainedModel:
    """The outermost transformers model inside any DDP / FSDP1 wrapper (module paths are relative to it)."""
    return next(m for m in model.modules() if isinstance(m, PreTrainedModel))


def wraps_vision(model: nn.Module) -> bool:
    """`model` (wrapped or not) is a vision-language model."""
    return is_vision(transformers_model(model).config)


def check_model_dir(path: str) -> bool:
    """True when model.path holds a vision-language model (its config.json), refused in one line when its
    family is not one llmtrain knows the parts of."""
    model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    if not is_vision_type(model_type):
        return False
    if model_type not in FAMILIES:
        raise ConfigError(f"model.path: {path} is a {model_type} vision-language model; llmtrain trains "
                          f"{', '.join(sorted(FAMILIES))} (llmtrain/models/vision.py FAMILIES)")
    return True


def parts(model: nn.Module) -> Parts:
    return FAMILIES[transformers_model(model).config.model_type]


def _module(model: nn.Module, path: str) -> nn.Module:
    return transformers_model(model).get_submodule(path)


def _params(model: nn.Module, path: str) -> set[int]:
    return {id(p) for p in _module(model, path).parameters()}


def part_params(model: nn.Module, part: str) -> set[int]:
    """ids of the parameters of one of PART_NAMES (the tower without the projector inside it)."""
    p = parts(model)
    if part == "vision_tower":
        return _params(model, p.tower) - _params(model, p.projector)
    if part == "projector":
        return _params(model, p.projector)
    # the language model with its embeddings and output layer (lm_head sits beside it)
    return {id(q) for q in model.parameters()} - _params(model, p.tower) - _params(model, p.projector)


def freeze(model: nn.Module, frozen: list[str]) -> None:
    """requires_grad off for the parameters of the `frozen` parts (model.freeze)."""
    ids = set().union(*(part_params(model, part) for part in frozen)) if frozen else set()
    for q in model.parameters():
        if id(q) in ids:
            q.requires_grad_(False)


def adaptable(model: nn.Module, frozen: list[str]) -> list[str]:
    """LoRA on a vision-language model: the names of the linear layers it may adapt, those of the parts that
    train (not in model.freeze: by default the projector and the language model), never the output layer."""
    out = model.get_output_embeddings()
    off = set().union(*(part_params(model, part) for part in frozen)) if frozen else set()
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not out
            and not any(id(q) in off for q in m.parameters())]


def language_layers(model: nn.Module) -> list[nn.Module]:
    """The language model's decoder layers (QLoRA quantizes theirs only: the vision tower stays exact)."""
    return list(_module(model, parts(model).layers))


def wrap_units(model: nn.Module) -> list[nn.Module]:
    """The modules each sharded as a unit (the root is the caller's): the vision blocks, the projector, the
    tower's other children with weights (embeddings, norms), the decoder layers. The tower itself is no unit:
    it is a transformers model whose outputs (LLaVA's hidden states) transformers records by its exact class,
    which FSDP2's wrapping replaces."""
    p = parts(model)
    blocks, projector = list(_module(model, p.blocks)), _module(model, p.projector)
    inner = {id(m) for m in [*blocks, projector]}
    rest = [c for c in _module(model, p.tower).children()
            if not any(id(m) in inner for m in c.modules()) and any(True for _ in c.parameters())]
    return [*blocks, projector, *rest, *_module(model, p.layers)]


def block_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The repeated block classes of both towers (activation checkpointing, compile, the log)."""
    p = parts(model)
    return {type(_module(model, p.blocks)[0]), type(_module(model, p.layers)[0])}
