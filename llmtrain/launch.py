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


def _true(value: str | None) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def check_accelerate(section: ParallelConfig, environ: Mapping[str, str]) -> list[str]:
    """Reconcile `accelerate launch` settings (from `environ`) with parallel.*: returns lines to log, raises
    ConfigError listing every setting accelerate asks for that parallel.* does not give. No accelerate
    variables: returns []. Never changes `section`."""
    if not any(k.startswith("ACCELERATE_") for k in environ):
        return []
    asks: list[str] = []        # what accelerate asks for and parallel.* agrees with
    conflicts: list[str] = []   # what accelerate asks for and parallel.* does not give
    unused: list[str] = []

    def want(what: str, key: str, value, current) -> None:
        if current == value:
            asks.append(f"{what} = {key}={_fmt(value)}")
        else:
            conflicts.append(f"{what}: set {key}={_fmt(value)} (it is {_fmt(current)})")

    def unsupported(what: str, instead: str) -> None:
        conflicts.append(f"{what}: not supported by this recipe; {instead}")

    if _true(environ.get("ACCELERATE_USE_DEEPSPEED")):
        unsupported("DeepSpeed (ACCELERATE_USE_DEEPSPEED)", "for ZeRO-3-style sharding use parallel.strategy=fsdp2")
    if _true(environ.get("ACCELERATE_USE_MEGATRON_LM")):
        unsupported("Megatron-LM (ACCELERATE_USE_MEGATRON_LM)", "use parallel.strategy=fsdp2")
    if _true(environ.get("ACCELERATE_USE_PARALLELISM_CONFIG")):
        for kind in ("TP", "CP", "SP"):
            size = environ.get(f"PARALLELISM_CONFIG_{kind}_SIZE", "1")
            if size not in ("", "1"):
                unsupported(f"PARALLELISM_CONFIG_{kind}_SIZE={size}", "only data parallelism (parallel.*) is")
        replicate = environ.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1")
        if replicate not in ("", "1"):
            want(f"HSDP replicas (PARALLELISM_CONFIG_DP_REPLICATE_SIZE={replicate})", "parallel.replicate",
                 int(replicate), section.replicate)

    if _true(environ.get("ACCELERATE_USE_FSDP")):
        version = environ.get("FSDP_VERSION", "1").strip()
        strategy = {"1": "fsdp", "2": "fsdp2"}.get(version)
        if strategy is None:
            unsupported(f"FSDP_VERSION={version}", "use 1 or 2")
        else:
            want(f"FSDP version {version} (ACCELERATE_USE_FSDP, FSDP_VERSION)", "parallel.strategy", strategy,
                 section.strategy)
        if version == "1":
            raw = environ.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").strip().upper()
            name = _SHARDING[int(raw) - 1] if raw.isdigit() and 1 <= int(raw) <= len(_SHARDING) else raw
            if name == "HYBRID_SHARD_ZERO2":
                unsupported("FSDP_SHARDING_STRATEGY=HYBRID_SHARD_ZERO2", "use HYBRID_SHARD with parallel.replicate")
            elif name != "FULL_SHARD":
                want(f"FSDP1 sharding (FSDP_SHARDING_STRATEGY={raw})", "parallel.sharding_strategy", name,
                     section.sharding_strategy)
        elif version == "2" and environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").strip().lower() == "false":
            want("FSDP_RESHARD_AFTER_FORWARD=false", "parallel.reshard_after_forward", False,
                 section.reshard_after_forward)
        if _true(environ.get("FSDP_OFFLOAD_PARAMS")):
            want("FSDP_OFFLOAD_PARAMS=true", "parallel.cpu_offload", True, section.cpu_offload)
        if _true(environ.get("FSDP_ACTIVATION_CHECKPOINTING")):
            want("FSDP_ACTIVATION_CHECKPOINTING=true", "parallel.activation_checkpointing", True,
                 section.activation_checkpointing)
        if _true(environ.get("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD")):
            unsupported("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD=true", "use parallel.activation_checkpointing")
        if environ.get("FSDP_IGNORED_MODULES"):
            unsupported(f"FSDP_IGNORED_MODULES={environ['FSDP_IGNORED_MODULES']}", "every decoder layer is sharded")
        unused = [f"{k}={environ[k]} ({why})" for k, why in _FIXED_BY_RECIPE.items() if k in environ]

    mixed = environ.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    if mixed in _MIXED:
        want(f"mixed precision {mixed} (ACCELERATE_MIXED_PRECISION)", "parallel.mixed_precision", _MIXED[mixed],
             section.mixed_precision)
    elif mixed not in ("no", ""):
        unsupported(f"ACCELERATE_MIXED_PRECISION={mixed}", "parallel.mixed_precision is fp32, bf16 or fp16")
    dynamo = environ.get("ACCELERATE_DYNAMO_BACKEND", "NO").strip().upper()
    if dynamo == "INDUCTOR":
        want("torch.compile (ACCELERATE_DYNAMO_BACKEND=INDUCTOR)", "parallel.compile", True, section.compile)
    elif dynamo not in ("NO", ""):
        unsupported(f"ACCELERATE_DYNAMO_BACKEND={dynamo}", "parallel.compile=true compiles with inductor")

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
