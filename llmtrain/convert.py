"""Offline converter: a sharded training checkpoint -> the Hugging Face layout of the recipe's export.

    python -m llmtrain.convert output_dir/checkpoints/step_<N> OUT [--dtype bf16] [--max-shard-size 5GB]

A LoRA checkpoint (adapters only) becomes OUT/adapter (PEFT) and/or OUT/hf (merged onto model.path's base),
as its lora.export says. A vision-language model's checkpoint holds its trained weights only: the frozen parts
(model.freeze) come from the run's model.path, and OUT/hf gets that model's processor files.

One process, no GPU, no process group. Each model tensor is allocated once, in the target dtype, and
DCP reads the shards straight into it: never more than one full copy of the weights."""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from llmtrain.checkpoint import HF_CONFIG_DIR, STATE_FILE, is_complete, verify
from llmtrain import data
from llmtrain.config import Config, ConfigError, load_config
from llmtrain.data import vision as vision_data
from llmtrain.export import LORA_OUTPUTS, write_adapter, write_hf
from llmtrain.models import lora, nf4, vision
from llmtrain.models.hf import WEIGHTS_FILE, WEIGHTS_INDEX, build_meta_model, model_type, read_weights
from llmtrain.utils import DTYPES, nesting

PREFIX = "model."
# What an export's files end with: config, weights and their index, tokenizer files (json, sentencepiece .model,
# merges.txt), chat_template.jinja. Anything else in a directory (a run's yaml, jsonl, logs) is not an export's.
EXPORT_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".jinja")


class CheckpointError(ValueError):
    """The checkpoint cannot be read as a model (the message names it)."""


@dataclass
class CheckpointModel:
    """A checkpoint's model, in memory: weights by their Hugging Face names (the adapters only, in fp32, for
    a LoRA checkpoint), the model config and tokenizer saved with it."""
    weights: dict[str, torch.Tensor]
    config: object
    tokenizer: object
    lora: bool


def is_lora(ckpt: Path) -> bool:
    """Whether a checkpoint holds LoRA adapters only; CheckpointError when it is missing or incomplete."""
    if not ckpt.exists():
        raise CheckpointError(f"{ckpt}: no such checkpoint (they are output_dir/checkpoints/step_<N>)")
    if not is_complete(ckpt):
        raise CheckpointError(f"{ckpt} is not a complete llmtrain checkpoint (no {STATE_FILE} or .metadata)")
    return bool(json.loads((ckpt / STATE_FILE).read_text()).get("base"))


def read_checkpoint(ckpt: Path, dtype: str) -> CheckpointModel:
    from transformers import AutoConfig, AutoTokenizer

    lora = is_lora(ckpt)
    if problems := verify(ckpt):
        raise CheckpointError(f"{ckpt} fails verification: {'; '.join(problems[:3])}")
    reader = dcp.FileSystemReader(str(ckpt))
    meta = reader.read_metadata().state_dict_metadata
    # A LoRA checkpoint holds its adapters in fp32 (they are merged in fp32, then cast).
    state = {key: torch.empty(m.size, dtype=torch.float32 if lora else DTYPES[dtype]) for key, m in meta.items()
             if key.startswith(PREFIX) and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # no_dist=True still warns that it loads in one process, as meant here
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    config = AutoConfig.from_pretrained(ckpt / HF_CONFIG_DIR)
    tokenizer = AutoTokenizer.from_pretrained(ckpt / HF_CONFIG_DIR)
    weights = {key[len(PREFIX):]: state.pop(key) for key in list(state)}
    return CheckpointModel(weights, config, tokenizer, lora)


def lora_config(ckpt: Path):
    """The run's config of a LoRA checkpoint, once model.path is checked to be the base it was trained on."""
    cfg = load_config(ckpt / "config.yaml")
    try:
        saved = json.loads((ckpt / STATE_FILE).read_text()).get("base") or {}
        lora.check_resume(ckpt, saved, lora.fingerprint(cfg.model.path, cfg.model.config, cfg.train.seed))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    return cfg


def _weight_names(model) -> set[str]:
    """The model's weights by their names (a tied output layer once, as the embedding)."""
    return {n for n, _ in model.named_parameters()}


def with_frozen(cfg: Config, trained: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """A vision-language model's checkpoint weights with the frozen parts it does not hold, read from the run's
    model.path."""
    missing = _weight_names(build_meta_model(config, cfg.model)) - trained.keys()
    if missing and cfg.model.path is None:
        raise CheckpointError("the frozen parts were a random init (model.config), which the checkpoint does not "
                              "hold; the recipe's own export has the whole model")
    return {**(read_weights(config, missing, Path(cfg.model.path)) if missing else {}), **trained}


def merged_lora(cfg: Config, trained: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """model.path's base weights with the checkpoint's adapters merged in (fp32); a QLoRA base as the
    dequantized NF4 weights the adapters trained on."""
    if cfg.model.path is None:
        raise CheckpointError("the base was a random init (model.config), not a model directory: only the "
                              "adapter can be converted; the recipe's own export has the merged model")
    meta = build_meta_model(config, cfg.model)
    base = read_weights(config, _weight_names(meta), Path(cfg.model.path))
    if cfg.lora.quantize_base == "nf4":
        base = nf4.round_trip(base, lora.apply(meta, cfg.lora, cfg.model.freeze), cfg.lora)
    return lora.merge(base, trained, cfg.lora)


def is_export(path: Path) -> bool:
    """Whether a directory is a Hugging Face export (config.json and safetensors weights) or a PEFT adapter
    (adapter_config.json and its weights) and holds nothing a run writes: no file of other kinds, no directory
    but its own step_<N> exports."""
    names = {p.name for p in path.iterdir()}
    if not ({"config.json", WEIGHTS_FILE} <= names or {"config.json", WEIGHTS_INDEX} <= names
            or {lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS} <= names):
        return False
    for entry in path.iterdir():
        if entry.is_dir() and not (re.fullmatch(r"step_\d+", entry.name) and is_export(entry)):
            return False
        if not entry.is_dir() and entry.suffix not in EXPORT_SUFFIXES:
            return False
    return True


def check_out(ckpt: Path, out: Path, lora_export: tuple[str, ...] | None, base: str | None, overwrite: bool) -> None:
    """Before anything is read: OUT leaves the checkpoint, its run and (LoRA) the base the adapters merge onto as
    they are; a non-empty OUT is replaced only with `overwrite`, and only when it is a previous export (is_export;
    for a LoRA checkpoint: OUT holds its adapter/ and hf/ exports alone)."""
    target, at = out.resolve(), ckpt.resolve()
    run = at.parent.parent if at.parent.name == "checkpoints" else at
    guarded = (("the run directory of the checkpoint", run if nesting(target, run) != "lies inside" else None),
               ("the checkpoint", at), ("model.path, the base the adapters merge onto", base))
    for what, place in guarded:  # OUT beside a run's checkpoints (OUT=run/hf-step100): as any OUT, below
        if place and (how := nesting(target, Path(place).resolve())):
            raise CheckpointError(f"OUT {out} {how} {what} ({place}): converting there would replace what it "
                                  "reads; choose another OUT")
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not overwrite:
        raise CheckpointError(f"{out} exists: pass --overwrite to replace it")
    parts = [out] if lora_export is None else list(out.iterdir())
    for part in parts:
        if (lora_export is not None and part.name not in lora_export) or not (part.is_dir() and is_export(part)):
            raise CheckpointError(f"{out} is not a previous export ({part} is not one of its directories): "
                                  "--overwrite replaces only what an export wrote; choose another OUT")


def convert(ckpt: Path, out: Path, dtype: str, max_shard_size: str, overwrite: bool = False) -> list[Path]:
    """The checkpoint's export written to `out` (a LoRA checkpoint's to out/adapter and/or out/hf, as its
    lora.export says). A non-empty `out` is replaced only with `overwrite`, and only when it is a previous export:
    refused (before the checkpoint is read) otherwise (check_out). CheckpointError names what is wrong."""
    vlm = vision.is_vision_type(model_type(ckpt / HF_CONFIG_DIR))
    cfg = lora_config(ckpt) if is_lora(ckpt) else None
    targets = [out] if cfg is None else [out / name for name in LORA_OUTPUTS[cfg.lora.export]]
    check_out(ckpt, out, None if cfg is None else LORA_OUTPUTS[cfg.lora.export], cfg and cfg.model.path, overwrite)
    run, processor = cfg, None
    if vlm:  # its processor (and frozen parts) are the run's model.path's
        run = cfg or load_config(ckpt / "config.yaml")
        try:
            processor = vision_data.load_processor(run.model.path, run.model.trust_remote_code,
                                                   data.chat_template(run.data))
        except (ConfigError, OSError) as e:
            raise CheckpointError(f"the run's model.path {run.model.path} (the processor and frozen parts of this "
                                  f"vision-language checkpoint): {e}") from None
    model = read_checkpoint(ckpt, dtype)
    if cfg is None:
        weights = with_frozen(run, model.weights, model.config) if vlm else model.weights
        write_hf(weights, out, model.config, model.tokenizer, DTYPES[dtype], max_shard_size, processor)
        return targets
    if "adapter" in LORA_OUTPUTS[cfg.lora.export]:
        write_adapter(model.weights, out / "adapter", cfg.lora, cfg.model.path)
    if "hf" in LORA_OUTPUTS[cfg.lora.export]:
        write_hf(merged_lora(cfg, model.weights, model.config), out / "hf", model.config, model.tokenizer,
                 DTYPES[dtype], max_shard_size, processor)
    return targets


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmtrain.convert", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path, help="output_dir/checkpoints/step_<N>")
    p.add_argument("out", type=Path, help="directory to write (an existing one only with --overwrite)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--overwrite", action="store_true", help="replace OUT (atomically) if it exists")
    args = p.parse_args(argv)
    try:
        written = convert(args.checkpoint, args.out, args.dtype, args.max_shard_size, args.overwrite)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
