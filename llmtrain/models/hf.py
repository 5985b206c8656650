"""Models and tokenizers from transformers: config, construction with parameters on meta (buffers real),
weight loading that does not multiply host RAM by the number of ranks, and a check that nothing was left
uninitialised."""

from __future__ import annotations

import collections
import json
import math
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor, distribute_tensor
from accelerate import init_empty_weights
from safetensors import SafetensorError, safe_open
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText,
                          AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig, PretrainedConfig)
from transformers.core_model_loading import revert_weight_conversion
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)

from llmtrain.config import ConfigError, ModelConfig, suggest
from llmtrain.models import attention, vision
from llmtrain.models.names import base_name, clean_name
from llmtrain.utils import release_freed_memory

WEIGHTS_INDEX = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"
# config.json "architectures" that are causal LMs (transformers' naming: LlamaForCausalLM, GPT2LMHeadModel).
CAUSAL_LM_CLASS = re.compile(r"(ForCausalLM|LMHeadModel)$")
# AutoModelForSequenceClassification's head (recipes/reward.py): absent from a causal LM's weights, so a reward
# model started from one gets it initialized (seeded, as transformers' _init_weights: normal, initializer_range).
SCORE_HEAD = "score.weight"


def check_paths(section: ModelConfig, tokenizer_path: str | None) -> None:
    """Fail before any process group exists when a named local directory is missing (or an inline
    model.config has a key its config class does not know)."""
    for key, path in (("model.path", section.path), ("tokenizer.path", tokenizer_path)):
        check_dir(key, path)
    if section.config is not None:
        check_inline_config(section.config)
    if section.path is not None and Path(section.path).is_dir():
        check_model_dir(section.path)


def attention_shape(section: ModelConfig) -> tuple[str, int, int]:
    """Before any process group: (the attention implementation the model gets, its attention heads, its key/value
    heads), from model.path's config.json or the inline model.config."""
    if section.path is not None:
        config = AutoConfig.from_pretrained(section.path, trust_remote_code=section.trust_remote_code)
    else:
        config = LlamaConfig(**section.config)
    config = getattr(config, "text_config", None) or config
    heads = config.num_attention_heads
    return (attention.choose(section.attn_implementation, config)[0], heads,
            getattr(config, "num_key_value_heads", None) or heads)


def check_model_dir(path: str, key: str = "model.path") -> None:
    """A Hugging Face directory llmtrain loads: its config.json, a causal LM, not quantized, readable weights; a
    problem names `key` (another model's: distill.teacher_path)."""
    try:
        if not (Path(path) / "config.json").is_file():
            raise ConfigError(f"model.path: {path} has no config.json (not a Hugging Face model directory)")
        check_causal_lm(path)
        check_not_quantized(path)
        check_weights(Path(path))
    except ConfigError as e:
        raise ConfigError(str(e).replace("model.path", key, 1)) from None


def check_vocab(tokenizer, other, key: str, other_path: str) -> None:
    """Two models that compare their next-token distributions id by id share one vocabulary: the same number
    of ids with the same token strings (their embeddings may be padded beyond it). tokenizer: this run's;
    other: the one at `other_path`, set by `key`."""
    n, n_other = len(tokenizer), len(other)
    if n != n_other:
        raise ConfigError(f"{key}: the tokenizer of {other_path} has {n_other} tokens, this run's {n}: the models "
                          "need one vocabulary (padding beyond it is fine)")
    ids = range(n)
    for i, (a, b) in enumerate(zip(tokenizer.convert_ids_to_tokens(ids), other.convert_ids_to_tokens(ids))):
        if a != b:
            raise ConfigError(f"{key}: token id {i} is {b!r} in the tokenizer of {other_path} but {a!r} in this "
                              "run's: the models need one vocabulary")


def check_inline_config(inline: dict) -> None:
    """Every key of an inline model.config is one LlamaConfig reads (its legacy spellings, e.g. rope_theta,
    included): any other would be kept as a plain attribute, train nothing and land in the export's config.json.
    The values are load_model_config's to check (with the tokenizer's ids)."""
    known = LlamaConfig().to_dict()
    other = {k: v for k, v in inline.items() if k not in known}
    try:  # the keys LlamaConfig does not consume stay in its dict
        kept = LlamaConfig(**other).to_dict()
    except (TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"model.config: {e}") from None
    for key in (k for k in other if k in kept):
        raise ConfigError(f"unknown config key 'model.config.{key}' (not a LlamaConfig key)"
                          f"{suggest(f'model.config.{key}', [f'model.config.{k}' for k in known])}")


def check_dir(key: str, path: str | None) -> None:
    """A path that names a local directory (not a hub id such as org/name) must be one."""
    if path is None:
        return
    local = Path(path)
    looks_local = local.is_absolute() or path.startswith(".") or local.exists() or path.count("/") != 1
    if looks_local and local.exists() and not local.is_dir():
        raise ConfigError(f"{key}: {path} is a file, not a directory (name the directory that holds it)")
    if looks_local and not local.is_dir():
        raise ConfigError(f"{key}: no such directory: {path}")


def model_type(path: str) -> str | None:
    """config.json's model_type of a local model directory (None for a Hub id or a directory without one)."""
    config = Path(path) / "config.json"
    return json.loads(config.read_text()).get("model_type") if config.is_file() else None


def check_causal_lm(path: str) -> None:
    """Only decoder-only causal LMs train here: an encoder (BERT), an encoder-decoder (T5), a base model
    without its LM head (LlamaModel) or a classifier is refused from config.json, before any process group."""
    hf = json.loads((Path(path) / "config.json").read_text())
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    if vision.check_model_dir(path):  # an image-text-to-text model: its language model is a causal LM
        return
    if hf.get("is_encoder_decoder") or (archs and not all(CAUSAL_LM_CLASS.search(a) for a in archs)):
        raise ConfigError(f"model.path: {path} is a {', '.join(archs) or model_type} (config.json), not a "
                          "decoder-only causal LM (a ...ForCausalLM); llmtrain fine-tunes causal LMs only")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and "AutoModelForCausalLM" not in hf.get("auto_map", {}):
        raise ConfigError(f"model.path: {path} has model_type {model_type!r}, which transformers has no causal "
                          "LM class for")


def check_not_quantized(path: str) -> None:
    """A pre-quantized checkpoint (bitsandbytes, GPTQ, AWQ...: config.json's quantization_config) is refused:
    its packed weights and quant state are not the full-precision tensors the loader shards, and a
    bitsandbytes base would not survive FSDP2's sharded state dict. QLoRA quantizes at load instead."""
    quant = json.loads((Path(path) / "config.json").read_text()).get("quantization_config")
    if quant:
        method = quant.get("quant_method", "unknown method") if isinstance(quant, dict) else quant
        raise ConfigError(f"model.path: {path} is quantized (config.json quantization_config: {method}); llmtrain "
                          "loads full-precision weights: point model.path at the original (unquantized) model, and "
                          "set lora.quantize_base=nf4 for a 4-bit base (QLoRA, quantized once loaded)")


def check_weights(path: Path) -> None:
    """Every safetensors file of a model directory opens (safetensors checks that its header and size agree),
    so a truncated download is named at set-up rather than failing inside the loader."""
    index = path / WEIGHTS_INDEX
    try:
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()}) \
            if index.is_file() else [path / WEIGHTS_FILE]
    except (ValueError, KeyError, AttributeError) as e:
        raise ConfigError(f"model.path: {index} is not a valid safetensors index ({e}); download it again") from None
    for file in files:
        if not file.is_file():
            raise ConfigError(f"model.path: {path} has no {file.name}" + (f" (listed in {WEIGHTS_INDEX})" if
                              index.is_file() else f" or {WEIGHTS_INDEX} (safetensors only; pickled .bin weights "
                              "are not loaded)"))
        try:
            with safe_open(file, framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"model.path: {file} is not a readable safetensors file ({e}): truncated or corrupt; "
                              "download it again") from None


def check_seq_len(config: PretrainedConfig, seq_len: int, whose: str = "the model's") -> None:
    """Positions past max_position_embeddings were never trained (and some families index past their table)."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        raise ConfigError(f"data.seq_len={seq_len} is longer than {whose} max_position_embeddings={limit}; "
                          "lower data.seq_len (or extend that context in its config first)")


def load_tokenizer(path: str, trust_remote_code: bool, key: str | None = None, holds: str = ""):
    """The tokenizer at `path`. key: the config key that named `path`; transformers' error for a directory
    without tokenizer files is then one line naming it, followed by `holds` (what that directory should hold)."""
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        if key is None:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{key}: no tokenizer could be loaded from {path} ({first[:200]})"
                          + (f"; {holds}" if holds else "")) from None
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
        # what loaders that pick a class by config.json (pipelines, TRL and vLLM by path) read in the export
        config.architectures = config.architectures or ["LlamaForCausalLM"]
    vocab_size = config.get_text_config().vocab_size
    if vocab_size < len(tokenizer):
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                          f"{vocab_size}; use a matching tokenizer.path")
    # A vision-language model's rows are padded, not packed: transformers' own kernel (the chunked sdpa assumes a
    # causal mask, which a vision tower's attention is not).
    config._attn_implementation = section.attn_implementation if vision.is_vision(config) else \
        attention.choose(section.attn_implementation, config)[0]
    config.use_cache = False
    return config


def as_score_model(config: PretrainedConfig, tokenizer) -> PretrainedConfig:
    """The config of a one-score sequence classifier on the same body (a Bradley-Terry reward model):
    transformers' class for the family, num_labels 1, the score read at the last token that is not the
    tokenizer's pad (what the recipes' collate pads with)."""
    if config.model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        raise ConfigError(f"model.path: transformers has no sequence-classification class for model_type "
                          f"{config.model_type!r}, so it cannot carry a reward head")
    config.architectures = [MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES[config.model_type]]
    config.num_labels = 1
    config.pad_token_id = tokenizer.pad_token_id
    return config


def model_class(config: PretrainedConfig):
    """The transformers auto class a config is built with: a sequence classifier's (as_score_model), an image-text
    model's or a causal LM's."""
    if vision.is_vision(config):
        return AutoModelForImageTextToText
    archs = config.architectures or []
    return AutoModelForSequenceClassification if any(a.endswith("ForSequenceClassification") for a in archs) \
        else AutoModelForCausalLM


def end_of_turn_ids(tokenizer) -> list[int]:
    """The special token(s) the tokenizer's chat template writes right after an assistant message (Llama 3's
    <|eot_id|>, ChatML's <|im_end|>, Gemma's <end_of_turn>), [] without a template or when the template ends
    a turn with plain text: generation must stop there as well as at EOS."""
    if not tokenizer.chat_template:
        return []
    text = tokenizer.apply_chat_template([{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}],
                                         tokenize=False)
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    tail = tokenizer(text[text.rindex("B") + 1:], add_special_tokens=False)["input_ids"]
    return [t for t in tail if t in special][:1]


def stop_ids(config_eos, tokenizer) -> list[int]:
    """Every id generation stops at: the model config's EOS id(s), the tokenizer's and its chat turn's end."""
    ids = set(config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids | set(end_of_turn_ids(tokenizer)))


def build_meta_model(config: PretrainedConfig, section: ModelConfig) -> nn.Module:
    """Parameters on meta (no memory until the parallelized model is materialized); buffers real, as the
    modules compute them (RoPE inv_freq, Gemma's embed_scale): no checkpoint holds non-persistent buffers,
    and materialize() keeps these values (a meta build would leave them as garbage after to_empty)."""
    with init_empty_weights(include_buffers=False):
        # The attention implementation comes with the config (load_model_config set it).
        model = model_class(config).from_config(config, trust_remote_code=section.trust_remote_code,
                                                dtype=torch.float32)
    model.tie_weights()  # init_empty_weights re-creates each parameter on meta, which unties them
    return model


def decoder_layer_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The repeated block classes to shard/checkpoint, from the model itself (not hard-coded to Llama); a
    vision-language model's from its family's parts (both towers' blocks)."""
    if vision.wraps_vision(model):
        return vision.block_classes(model)
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


def wrap_units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded as units of their own below the root, innermost first: the decoder layers, or a
    vision-language model's parts (models.vision.wrap_units: a frozen tower never shares a unit with trained
    weights)."""
    return vision.wrap_units(model) if vision.wraps_vision(model) else decoder_layers(model)


def _weight_files(path: Path) -> dict[str, Path]:
    """{tensor name: safetensors file} for model.path, from the index or the file's header."""
    index = path / WEIGHTS_INDEX
    if index.is_file():
        return {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    if (path / WEIGHTS_FILE).is_file():
        with safe_open(path / WEIGHTS_FILE, framework="pt") as f:
            return dict.fromkeys(f.keys(), path / WEIGHTS_FILE)
    raise ConfigError(f"model.path: {path} has no {WEIGHTS_FILE} or {WEIGHTS_INDEX} (safetensors only; "
                      "pickled .bin weights are not loaded)")


def has_score_head(path: str) -> bool:
    """Whether a model directory's weights hold a sequence classifier's score head (a reward model's)."""
    return SCORE_HEAD in _weight_files(Path(path))


def _stored_names(config: PretrainedConfig, names, path: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """For the model's tensor `names`: ({name: its safetensors file}, {name: its name in that file}). A name the
    files lack may be stored under transformers' checkpoint layout (a vision-language model saved by
    save_pretrained: `language_model.model.layers...` for `model.language_model.layers...`): transformers' own
    save-time renaming (revert_weight_conversion) gives it, as from_pretrained undoes it."""
    on_disk = _weight_files(path)
    absent = {n: torch.empty(0) for n in names if n not in on_disk}  # placeholders: their identity maps them back
    stored = {n: n for n in names if n in on_disk}
    if absent:  # the mapping is read from the modules' classes: a meta model's, unwrapped (FSDP1 wraps units)
        with init_empty_weights():
            lm = model_class(config).from_config(config)
        back = {id(t): n for n, t in absent.items()}
        stored |= {back[id(t)]: key for key, t in revert_weight_conversion(lm, dict(absent)).items()}
    return {n: on_disk[k] for n, k in stored.items() if k in on_disk}, stored


def read_weights(config: PretrainedConfig, names, path: Path) -> dict[str, torch.Tensor]:
    """{name: whole tensor} of the model's tensor `names` from model.path's safetensors, by the model's own names
    (a vision-language model's stored layout mapped back as from_pretrained does); one process (the converter)."""
    files, stored = _stored_names(config, names, path)
    _check_complete(names, files, config)
    out = {}
    for file in set(files.values()):
        with safe_open(file, framework="pt") as handle:
            out.update({n: handle.get_tensor(stored[n]) for n, f in files.items() if f == file})
    return out


def _random_init(config: PretrainedConfig, seed: int) -> dict[str, torch.Tensor]:
    """model.config: the seeded init, made on rank 0 only (the same for any strategy and world size)."""
    torch.manual_seed(seed)
    return model_class(config).from_config(config, dtype=torch.float32).state_dict()


def _fresh_heads(names, files: dict[str, Path]) -> set[str]:
    """A score head over a causal LM's weights: initialized here, not loaded."""
    return {n for n in names if n == SCORE_HEAD and n not in files}


def _head_init(shape, config: PretrainedConfig, seed: int) -> torch.Tensor:
    """The same on every rank (a seeded generator): nothing to send."""
    return torch.empty(shape).normal_(0.0, config.initializer_range, generator=torch.Generator().manual_seed(seed))


def load_slices(model: nn.Module, path: Path | None, config: PretrainedConfig, seed: int,
                 adapters: dict[str, torch.Tensor]) -> None:
    """fsdp2, ddp, none: fill the parameters (local DTensor shards or whole tensors) in place. From model.path
    every rank reads only the slices its shards cover (DCP's HuggingFaceStorageReader); a random init is
    sent from rank 0 tensor by tensor. `adapters` (LoRA) are full tensors every rank holds alike."""
    state = get_model_state_dict(model)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # one tensor for both: loaded through the embedding
    base, copies = {}, {}  # base: {base model name: target}; copies: LoRA modules_to_save, start as the base
    for name, target in state.items():
        if name in adapters:
            continue
        if base_name(name) in base:
            copies[name] = target
        else:
            base[base_name(name)] = target
    if path is not None:
        files, stored = _stored_names(config, base, path)
        fresh = _fresh_heads(base, files)
        _check_complete(set(base) - fresh, files, config)
        dcp.load({stored[n]: t for n, t in base.items() if n not in fresh},
                 storage_reader=HuggingFaceStorageReader(str(path)))
        for name in fresh:
            _fill(base[name], _head_init(base[name].shape, config, seed), src_rank=None)
    else:
        rank0 = dist.get_rank() == 0
        full = _random_init(config, seed) if rank0 else {}
        for name, target in base.items():
            device = target.device_mesh.device_type if isinstance(target, DTensor) else target.device
            src = full.pop(name).to(device) if rank0 else torch.empty(target.shape, device=device)
            _fill(target, src, src_rank=0)
    for name, target in copies.items():  # same shape and placement as the original: shard to shard
        original = base[base_name(name)]
        local = (lambda t: t.to_local()) if isinstance(target, DTensor) else (lambda t: t)
        local(target).copy_(local(original))
    for name, src in adapters.items():
        _fill(state[name], src, src_rank=None)
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


def _fill(target: torch.Tensor, src: torch.Tensor, src_rank: int | None) -> None:
    """Copy a full tensor into a parameter or its local shard; src_rank: whose `src` is the real one (the
    others' is a buffer to receive it), None when every rank holds the same."""
    if isinstance(target, DTensor):
        src = src.to(target.device_mesh.device_type)
        target.to_local().copy_(distribute_tensor(src, target.device_mesh, target.placements,
                                                  src_data_rank=src_rank).to_local())
    else:
        src = src.to(target.device)
        if src_rank is not None:
            dist.broadcast(src, src=src_rank)
        target.copy_(src)


def load_units(model: nn.Module, path: Path | None, config: PretrainedConfig, seed: int,
                      adapters: dict[str, torch.Tensor]) -> None:
    """fsdp: one FSDP unit at a time is gathered (summon_full_params), filled with full tensors and written
    back to the shards. FSDP1's own sharded load_state_dict would hold a whole copy of the model per rank."""
    names = {p: clean_name(n) for n, p in model.named_parameters()}  # tied embeddings: named once
    hf_names = {p: base_name(n) for p, n in names.items() if n not in adapters}
    uses = collections.Counter(hf_names.values())  # LoRA modules_to_save: the original and its copy
    rank0 = dist.get_rank() == 0
    if path is not None:
        files, stored = _stored_names(config, set(hf_names.values()), path)
        fresh = _fresh_heads(hf_names.values(), files)
        _check_complete(set(hf_names.values()) - fresh, files, config)
        handles = {file: safe_open(file, framework="pt") for file in set(files.values())}
    else:
        full = _random_init(config, seed) if rank0 else {}
    for unit in FSDP.fsdp_modules(model):  # the root first, so that it is initialized as the root
        nested = {p for sub in FSDP.fsdp_modules(unit) if sub is not unit for p in sub.parameters()}
        with FSDP.summon_full_params(unit, recurse=False, writeback=True), torch.no_grad():
            for p in unit.parameters():
                if p in nested:
                    continue
                if p not in hf_names:
                    p.copy_(adapters[names[p]])
                elif path is not None and hf_names[p] in fresh:
                    p.copy_(_head_init(p.shape, config, seed))
                elif path is not None:
                    _copy_in_blocks(p, handles[files[hf_names[p]]].get_slice(stored[hf_names[p]]))
                else:
                    name = hf_names[p]
                    uses[name] -= 1
                    src = (full[name] if uses[name] else full.pop(name)) if rank0 else torch.empty(p.shape)
                    dist.broadcast(src := src.to(p.device), src=0)
                    p.copy_(src)
        release_freed_memory()  # this unit's gathered copy


def _copy_in_blocks(target: torch.Tensor, source, block_bytes: int = 16 << 20) -> None:
    """Copy a safetensors slice into `target` ~16 MiB of rows at a time: no whole-size temporary (an
    embedding can be the largest tensor of the model)."""
    if target.dim() < 2:
        target.copy_(source[:])
        return
    rows = max(1, block_bytes // (target[0].numel() * target.element_size()))
    for start in range(0, len(target), rows):
        target[start:start + rows].copy_(source[start:start + rows])


def _check_complete(wanted, files: dict[str, Path], config: PretrainedConfig) -> None:
    missing = set(wanted) - set(files)
    if missing:
        raise ConfigError(f"model.path: weights missing for {sorted(missing)[:5]} "
                          f"({len(missing)} tensors); is this a {config.model_type} checkpoint?")


def materialize(module: nn.Module, device: torch.device, recurse: bool = True) -> None:
    """to_empty on `device`, then parameters (and any buffer that was on meta) set to NaN, a value no load
    leaves behind, so that check_initialized finds whatever was never loaded; the real buffers of
    build_meta_model get their values back. to_empty unties tied embeddings: the caller ties them again."""
    mods = module.modules() if recurse else [module]
    kept = [(m, name, b) for m in mods for name, b in m._buffers.items() if b is not None and not b.is_meta]
    module.to_empty(device=device, recurse=recurse)
    with torch.no_grad():
        for t in [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]:
            if t.is_floating_point():
                t.fill_(math.nan)
        for m, name, b in kept:
            m._buffers[name].copy_(b)


def _plain(t: torch.Tensor) -> bool:
    """Not a tensor subclass such as an NF4 base weight (checked before it was quantized: models.build)."""
    return type(t.to_local() if isinstance(t, DTensor) else t) in (torch.Tensor, nn.Parameter)


def check_initialized(model: nn.Module) -> None:
    """Collective. Raise on every rank if any rank holds a NaN parameter or buffer (never loaded since
    materialize's NaN fill, or NaN in model.path / the checkpoint), naming them: training on garbage
    would otherwise go unnoticed (Gemma's embed_scale did)."""
    bad = [clean_name(name) for name, t in [*model.named_parameters(), *model.named_buffers()]
           if _plain(t) and t.is_floating_point() and torch.isnan(t.to_local() if isinstance(t, DTensor) else t).any()]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, bad[:5])
    named = sorted({name for names in everyone for name in names})
    if named:
        raise FloatingPointError(f"NaN in {', '.join(named)} after loading: never initialised, or NaN in "
                                 "model.path / the checkpoint; refusing to train")
