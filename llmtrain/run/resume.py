"""What makes a run this run, and the one rule for resuming it with a changed setup.

Every checkpoint holds the resolved config (config.yaml), the model's config (hf_config/) and, in
trainer_state.json, the recipe's name and a fingerprint of the data files. Before anything is loaded, the
new run is compared with them key by key:
  - keys that may change (the step budget, the lr schedule, logging, eval, checkpoint cadence, the parallel
    strategy and world size, the loss implementation): the run continues and says what changed;
  - the batch split (train.micro_batch_size x train.grad_accum_steps x world size) may change while the global
    batch stays the same (one global data order);
  - model.path of a full fine-tune: the checkpoint's weights are used, and the log says so (LoRA's base is
    checked by its fingerprint, llmtrain.models.lora.check_resume); the architecture must match;
  - everything else (data, global batch, seed, optimizer settings, adapters, the recipe and its section):
    refused, naming every differing key with old -> new, unless listed in checkpoint.allow_changes (then a
    warning says what it means).
"""

from __future__ import annotations

import glob
import hashlib
import json
from pathlib import Path
from typing import NamedTuple

import yaml

from llmtrain.checkpoint import complete_checkpoints
from llmtrain.config import Config, ConfigError, DataConfig, to_dict
from llmtrain.data.sources import is_hub_id
from llmtrain.utils import hash_sampled

# Changing these keeps the run the same run (prefixes end with a dot).
MAY_CHANGE = ("train.max_steps", "train.lr", "train.scale_lr", "train.warmup_steps", "train.lr_schedule",
              "train.min_lr_ratio", "train.on_nan", "train.loss_impl", "train.loss_chunk_tokens",
              "model.attn_implementation", "model.path", "lora.export", "lora.init_from", "data.val_path",
              "output_dir", "parallel.", "distributed.", "log.", "eval.", "checkpoint.")
# Compared otherwise: the split by the global batch, the data by its fingerprint.
SPLIT = ("train.micro_batch_size", "train.grad_accum_steps")
DATA_FILES = ("data.path", "data.sources")
# The model config's keys that decide the shapes of the saved tensors.
ARCHITECTURE = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")


def data_fingerprint(section: DataConfig) -> str:
    """A hash of the training data files' names, sizes and (sampled) bytes: the same files at another path
    match."""
    h = hashlib.sha256()
    paths = [s.path for s in section.sources] if section.sources else [section.path]
    for path in paths:  # the training data; data.val_path is only evaluated
        if is_hub_id(path) and not Path(path).exists():
            h.update(path.encode())
            continue
        p = Path(path)
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else sorted(map(Path, glob.glob(path)))
        for f in files:
            size = f.stat().st_size
            h.update(f.name.encode() + size.to_bytes(8, "little"))
            with f.open("rb") as fh:
                hash_sampled(h, fh, 0, size)
    return h.hexdigest()[:16]


def identity(cfg: Config, recipe: str) -> dict:
    """What trainer_state.json records of the run beyond its config."""
    return {"recipe": recipe, "data": data_fingerprint(cfg.data)}


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and k != "config":  # model.config (an inline model) is one value
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _may_change(key: str) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in MAY_CHANGE)


class Verdict(NamedTuple):
    refused: list[str]  # "key: old -> new (why)", each a reason not to resume
    notes: list[str]    # what changed and is fine (or allowed by checkpoint.allow_changes), for the log


def compare(saved_cfg: dict, saved_state: dict, saved_model: dict, cfg: Config, current: dict, model_config: dict,
            world_size: int) -> Verdict:
    """The checkpoint's config.yaml, trainer_state.json and hf_config/config.json against the new run (current:
    its identity())."""
    old, new = _flat(saved_cfg), _flat(to_dict(cfg))
    allowed = set(cfg.checkpoint.allow_changes)
    refused, notes = [], []

    def differs(key: str, text: str, overridable: bool = True) -> None:
        if overridable and key in allowed:
            notes.append(f"{text} (allowed by checkpoint.allow_changes)")
        else:
            refused.append(text)

    saved_identity = saved_state.get("identity") or {}
    if saved_identity.get("recipe", current["recipe"]) != current["recipe"]:
        differs("recipe", f"recipe: {saved_identity['recipe']} -> {current['recipe']}", overridable=False)
    for key in sorted(old.keys() & new.keys()):
        if old[key] == new[key] or key in SPLIT or key in DATA_FILES:
            continue
        change = f"{key}: {old[key]!r} -> {new[key]!r}"
        if _may_change(key):
            notes.append(change + (" (the checkpoint's weights are used, not the new model.path's)"
                                   if key == "model.path" and not cfg.lora.enabled else ""))
        else:
            differs(key, change)
    old_batch = saved_state.get("global_batch")
    new_batch = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * world_size
    split = f"{old.get(SPLIT[0])} x {old.get(SPLIT[1])} x {saved_state.get('world_size')} ranks -> " \
            f"{cfg.train.micro_batch_size} x {cfg.train.grad_accum_steps} x {world_size} ranks"
    if old_batch and old_batch != new_batch:
        keys = [k for k in SPLIT if old.get(k) != new[k]] or ["world size"]
        differs(keys[0], f"{' and '.join(keys)}: global batch {old_batch} -> {new_batch} ({split}); the data order "
                         "and the loss curve change from here")
    elif any(old.get(k, new[k]) != new[k] for k in SPLIT):
        notes.append(f"batch split {split}, global batch {new_batch} unchanged")
    paths = [f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in DATA_FILES if k in old and old[k] != new[k]]
    if "data" not in saved_identity or saved_identity["data"] == current["data"]:
        notes.extend(f"{p} (the same files)" for p in paths)
    else:
        differs("data.path", f"{'; '.join(paths) or 'data.path'}: the data files differ from the checkpoint's "
                              f"(fingerprint {saved_identity['data']} -> {current['data']}); the data "
                              "position would point into other data")
    new_model = {k: model_config[k] for k in ARCHITECTURE if k in model_config}  # config.json's absent keys: None
    arch = [f"{k} {saved_model.get(k)} -> {new_model.get(k)}" for k in ARCHITECTURE
            if saved_model.get(k) != new_model.get(k)]
    if arch:
        key = "model.path" if cfg.model.path is not None else "model.config"
        differs(key, f"{key}: another architecture than the checkpoint's ({', '.join(arch)}); its tensors cannot "
                     "be loaded into this model", overridable=False)
    return Verdict(refused, notes)


def check(path: Path, cfg: Config, current: dict, model_config: dict, world_size: int, state_file: str,
          hf_config_dir: str) -> list[str]:
    """Raise a ConfigError naming every refused change (nothing is loaded, the checkpoint stays as it is);
    return the lines to log about the allowed ones."""
    saved_cfg = yaml.safe_load((path / "config.yaml").read_text()) if (path / "config.yaml").is_file() else {}
    saved_state = json.loads((path / state_file).read_text())
    model_file = path / hf_config_dir / "config.json"
    saved_model = json.loads(model_file.read_text()) if model_file.is_file() else model_config
    verdict = compare(saved_cfg, saved_state, saved_model, cfg, current, model_config, world_size)
    if verdict.refused:
        raise ConfigError(f"checkpoint {path} was saved by a different setup: {'; '.join(verdict.refused)}. Resume "
                          "with its settings (its config.yaml), start afresh (another output_dir or "
                          "checkpoint.resume=never), or list the keys you mean to change in "
                          "checkpoint.allow_changes")
    return [f"resuming with changed settings: {'; '.join(verdict.notes)}"] if verdict.notes else []


def check_budget(path: Path, saved_step: int, max_steps: int) -> None:
    """A train.max_steps below the step of the checkpoint resumed from would train nothing and export that
    later step's weights as if they were the run's: refused, naming the checkpoint to go back to."""
    if saved_step <= max_steps:
        return
    earlier = [p for step, p in complete_checkpoints(path.parent) if step <= max_steps]
    back = f", or go back with checkpoint.resume={earlier[-1]}" if earlier else \
        f" (no checkpoint at or before step {max_steps} to go back to: checkpoint.resume=never starts afresh)"
    raise ConfigError(f"train.max_steps={max_steps} is below the step of the checkpoint it resumes from ({path}, "
                      f"step {saved_step}): it would train nothing and export step {saved_step}'s weights. Raise "
                      f"train.max_steps above {saved_step} to continue{back}")
