"""Launchers other than torchrun: what `accelerate launch` asks for, checked against parallel.*.

`accelerate launch --multi_gpu` (or a config file with distributed_type MULTI_GPU) starts the recipe through
torchrun, which is all the recipe needs. Its other settings reach the training script only as environment
variables (ACCELERATE_USE_FSDP, FSDP_*, ACCELERATE_MIXED_PRECISION, ...) that an `Accelerator` would read.
This recipe has no Accelerator: it parallelizes the model itself and the parallel.* keys govern. So
check_accelerate() turns every setting accelerate actually asks for (a value other than accelerate's
default) into the parallel.* key that gives it, and stops before anything starts when parallel.* says
otherwise; nothing is silently trained differently from what was asked. FSDP settings that only select
an implementation detail the recipe fixes (wrap policy, prefetching, state-dict type, ...) are listed in
the log as not used.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from llmtrain.config import ConfigError, ParallelConfig

# accelerate's FSDP_SHARDING_STRATEGY may be a name or the ShardingStrategy number.
_SHARDING = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
_MIXED = {"fp16": "fp16", "bf16": "bf16"}
# FSDP_* variables whose choice the recipe makes itself (and why they do not change the result).
_FIXED_BY_RECIPE = {
    "FSDP_AUTO_WRAP_POLICY": "each decoder layer is wrapped, then the root",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "the model's decoder-layer class is found automatically",
    "FSDP_MIN_NUM_PARAMS": "wrapping is per decoder layer, not by size",
    "FSDP_BACKWARD_PREFETCH": "torch defaults",
    "FSDP_FORWARD_PREFETCH": "torch defaults",
    "FSDP_USE_ORIG_PARAMS": "FSDP1 always uses original parameters",
    "FSDP_STATE_DICT_TYPE": "checkpoints are sharded DCP, exports full safetensors",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "always: meta-device model, each rank reads only its shards",
    "FSDP_SYNC_MODULE_STATES": "always: every rank loads the same weights (a random init comes from rank 0)",
}


class Ask(NamedTuple):
    """A setting accelerate asks for: `what` (as accelerate spells it), the parallel.* `key` that gives it and the
    `value` that key must have; key None: the recipe cannot give it, and `value` says what to use instead."""
    what: str
    key: str | None
    value: object


def _true(value: str | None) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def _size(value: str | None) -> str:
    return "1" if value is None else value


def _fsdp_version(environ: Mapping[str, str]) -> str | None:
    return environ.get("FSDP_VERSION", "1").strip() if _true(environ.get("ACCELERATE_USE_FSDP")) else None


def _version(raw: str | None) -> Ask:
    version = (raw or "1").strip()
    if version not in ("1", "2"):
        return Ask(f"FSDP_VERSION={version}", None, "use 1 or 2")
    return Ask(f"FSDP version {version} (ACCELERATE_USE_FSDP, FSDP_VERSION)", "parallel.strategy",
               {"1": "fsdp", "2": "fsdp2"}[version])


def _sharding(raw: str | None) -> Ask | None:
    raw = (raw or "FULL_SHARD").strip().upper()
    name = _SHARDING[int(raw) - 1] if raw.isdigit() and 1 <= int(raw) <= len(_SHARDING) else raw
    if name == "HYBRID_SHARD_ZERO2":
        return Ask("FSDP_SHARDING_STRATEGY=HYBRID_SHARD_ZERO2", None, "use HYBRID_SHARD with parallel.replicate")
    if name != "FULL_SHARD":
        return Ask(f"FSDP1 sharding (FSDP_SHARDING_STRATEGY={raw})", "parallel.sharding_strategy", name)
    return None


def _mixed(raw: str | None) -> Ask | None:
    mixed = (raw or "no").strip().lower()
    if mixed in _MIXED:
        return Ask(f"mixed precision {mixed} (ACCELERATE_MIXED_PRECISION)", "parallel.mixed_precision", _MIXED[mixed])
    if mixed not in ("no", ""):
        return Ask(f"ACCELERATE_MIXED_PRECISION={mixed}", None, "parallel.mixed_precision is fp32, bf16 or fp16")
    return None


def _dynamo(raw: str | None) -> Ask | None:
    dynamo = (raw or "NO").strip().upper()
    if dynamo == "INDUCTOR":
        return Ask("torch.compile (ACCELERATE_DYNAMO_BACKEND=INDUCTOR)", "parallel.compile", True)
    if dynamo not in ("NO", ""):
        return Ask(f"ACCELERATE_DYNAMO_BACKEND={dynamo}", None, "parallel.compile=true compiles with inductor")
    return None


# When a rule applies (the launch's kind), read from the whole environment.
def _always(environ: Mapping[str, str]) -> bool:
    return True


def _parallelism(environ: Mapping[str, str]) -> bool:
    return _true(environ.get("ACCELERATE_USE_PARALLELISM_CONFIG"))


def _fsdp(environ: Mapping[str, str]) -> bool:
    return _fsdp_version(environ) is not None


def _fsdp1(environ: Mapping[str, str]) -> bool:
    return _fsdp_version(environ) == "1"


def _fsdp2(environ: Mapping[str, str]) -> bool:
    return _fsdp_version(environ) == "2"


# What accelerate asks for, in the order it is reported: (when the rule applies, the variable, its reading: the
# variable's raw value, None when unset -> an Ask, or None when it asks for nothing).
_RULES = [
    (_always, "ACCELERATE_USE_DEEPSPEED", lambda v: _true(v) and Ask(
        "DeepSpeed (ACCELERATE_USE_DEEPSPEED)", None, "for ZeRO-3-style sharding use parallel.strategy=fsdp2")),
    (_always, "ACCELERATE_USE_MEGATRON_LM", lambda v: _true(v) and Ask(
        "Megatron-LM (ACCELERATE_USE_MEGATRON_LM)", None, "use parallel.strategy=fsdp2")),
    *((_parallelism, f"PARALLELISM_CONFIG_{kind}_SIZE", lambda v, kind=kind: _size(v) not in ("", "1") and Ask(
        f"PARALLELISM_CONFIG_{kind}_SIZE={v}", None, "only data parallelism (parallel.*) is"))
      for kind in ("TP", "CP", "SP")),
    (_parallelism, "PARALLELISM_CONFIG_DP_REPLICATE_SIZE", lambda v: _size(v) not in ("", "1") and Ask(
        f"HSDP replicas (PARALLELISM_CONFIG_DP_REPLICATE_SIZE={v})", "parallel.replicate", int(v))),
    (_fsdp, "FSDP_VERSION", _version),
    (_fsdp1, "FSDP_SHARDING_STRATEGY", _sharding),
    (_fsdp2, "FSDP_RESHARD_AFTER_FORWARD", lambda v: (v or "true").strip().lower() == "false" and Ask(
        "FSDP_RESHARD_AFTER_FORWARD=false", "parallel.reshard_after_forward", False)),
    (_fsdp, "FSDP_OFFLOAD_PARAMS", lambda v: _true(v) and Ask(
        "FSDP_OFFLOAD_PARAMS=true", "parallel.cpu_offload", True)),
    (_fsdp, "FSDP_ACTIVATION_CHECKPOINTING", lambda v: _true(v) and Ask(
        "FSDP_ACTIVATION_CHECKPOINTING=true", "parallel.activation_checkpointing", True)),
    (_fsdp, "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", lambda v: _true(v) and Ask(
        "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD=true", None, "use parallel.activation_checkpointing")),
    (_fsdp, "FSDP_IGNORED_MODULES", lambda v: bool(v) and Ask(
        f"FSDP_IGNORED_MODULES={v}", None, "every decoder layer is sharded")),
    (_always, "ACCELERATE_MIXED_PRECISION", _mixed),
    (_always, "ACCELERATE_DYNAMO_BACKEND", _dynamo),
]


def check_accelerate(section: ParallelConfig, environ: Mapping[str, str]) -> list[str]:
    """Reconcile `accelerate launch` settings (from `environ`) with parallel.*: returns lines to log, raises
    ConfigError listing every setting accelerate asks for that parallel.* does not give. No accelerate
    variables: returns []. Never changes `section`."""
    if not any(k.startswith("ACCELERATE_") for k in environ):
        return []
    asks: list[str] = []        # what accelerate asks for and parallel.* agrees with
    conflicts: list[str] = []   # what accelerate asks for and parallel.* does not give
    for applies, variable, read in _RULES:
        if not applies(environ) or not (ask := read(environ.get(variable))):
            continue
        if ask.key is None:
            conflicts.append(f"{ask.what}: not supported by this recipe; {ask.value}")
        elif (current := getattr(section, ask.key.removeprefix("parallel."))) == ask.value:
            asks.append(f"{ask.what} = {ask.key}={_fmt(ask.value)}")
        else:
            conflicts.append(f"{ask.what}: set {ask.key}={_fmt(ask.value)} (it is {_fmt(current)})")
    unused = [f"{k}={environ[k]} ({why})" for k, why in _FIXED_BY_RECIPE.items() if k in environ] \
        if _fsdp(environ) else []

    if conflicts:
        raise ConfigError(
            "accelerate launch asks for settings that the parallel.* config does not give. This recipe "
            "parallelizes the model itself, so parallel.* governs and the accelerate settings are not applied:\n"
            + "".join(f"  - {c}\n" for c in conflicts)
            + "Set those parallel.* keys (in the YAML or as overrides after --config), or drop the settings "
              "from the accelerate config / command line (plain --multi_gpu, distributed_type: MULTI_GPU).")
    lines = [] if asks or unused else ["launched by accelerate: it asks for nothing beyond starting the processes"]
    if asks:
        lines.append("accelerate launch settings, given by parallel.*: " + "; ".join(asks))
    if unused:
        lines.append("accelerate FSDP settings not used (the recipe fixes them): " + "; ".join(unused))
    return lines


def _fmt(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
