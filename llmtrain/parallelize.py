"""parallelize(): one entry that applies, in a fixed order, one small function per technique:
activation checkpointing -> compile -> the strategy's wrap. A Strategy (one subclass per name: none, ddp,
fsdp, fsdp2) holds everything else that differs between them: how weights are loaded, weight access (the full
weights gathered for an export: full_weights; every weight gathered for decoding: unsharded; a parameter
swapped after wrapping: param_slots / reseat), gradient-sync suppression, clipping, autocast and loss
scaling, and how a frozen copy is wrapped. Nothing outside this module asks which strategy runs, nor reads
a wrapper's private attributes: it calls the Strategy's methods (holding() finds the strategy of a bare
wrapped model)."""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import PretrainedConfig

from llmtrain.config import ConfigError, ParallelConfig
from llmtrain.models import hf as model_lib
from llmtrain.models import ulysses
from llmtrain.models.hf import decoder_layers, wrap_units
from llmtrain.models.names import clean_name
from llmtrain.utils import DTYPES, release_freed_memory
# fp32 params + grads + two AdamW moments; activations and temporaries need the rest.
TRAIN_BYTES_PER_PARAM = 16
AUTO_DDP_FRACTION = 0.35


@dataclass(frozen=True)
class Plan:
    """What resolve() chose: the strategy (its .name for logs), why, and the compute dtype."""
    strategy: Strategy
    reason: str
    dtype: torch.dtype

    @property
    def autocast(self) -> bool:
        return self.dtype != torch.float32 and self.strategy.autocasts


def check(section: ParallelConfig, world_size: int, device_type: str) -> None:
    """Combinations that cannot work, named before any process group or model exists."""
    s = section.strategy
    if s == "none" and world_size > 1:
        raise ConfigError(f"parallel.strategy=none trains a single process but {world_size} were launched; "
                          "use ddp, fsdp, fsdp2 or auto")
    if world_size % section.replicate:
        raise ConfigError(f"parallel.replicate={section.replicate} must divide the world size {world_size}")
    if section.replicate > 1 and s not in ("fsdp", "fsdp2", "auto"):
        raise ConfigError("parallel.replicate > 1 (HSDP) needs parallel.strategy fsdp or fsdp2")
    if s == "fsdp" and (section.sharding_strategy == "HYBRID_SHARD") != (section.replicate > 1):
        raise ConfigError("parallel.sharding_strategy=HYBRID_SHARD goes with parallel.replicate > 1 "
                          "(the number of replica groups), and replicate > 1 with HYBRID_SHARD")
    if s == "fsdp" and section.sharding_strategy == "HYBRID_SHARD" and world_size == section.replicate:
        # FSDP1 turns a 1-rank shard group into NO_SHARD and then never syncs across replicas.
        raise ConfigError("parallel.sharding_strategy=HYBRID_SHARD with 1 rank per replica group does not sync "
                          "gradients under FSDP1; use parallel.strategy=fsdp2 (HSDP) or ddp")
    if section.cpu_offload and s in ("ddp", "none"):
        raise ConfigError("parallel.cpu_offload needs parallel.strategy fsdp or fsdp2")
    if section.cpu_offload and device_type != "cuda":
        raise ConfigError("parallel.cpu_offload moves parameters from the GPU to the CPU; on a CPU run they are "
                          "there already: set parallel.cpu_offload=false")


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // ranks_here


def trained_and_frozen(model: nn.Module) -> tuple[int, int]:
    """(trained parameters, bytes of the frozen ones): a frozen LoRA base has no gradients or optimizer state."""
    params = list(model.parameters())
    return (sum(p.numel() for p in params if p.requires_grad),
            sum(p.numel() * p.element_size() for p in params if not p.requires_grad))


def resolve(section: ParallelConfig, n_params: int, world_size: int, device: torch.device,
            frozen_bytes: int = 0) -> Plan:
    """n_params: the trained parameters; frozen_bytes: the storage of frozen ones (trained_and_frozen)."""
    dtype = DTYPES[section.mixed_precision]
    if section.strategy != "auto":
        return Plan(STRATEGIES[section.strategy], "set by parallel.strategy", dtype)
    need, have = n_params * TRAIN_BYTES_PER_PARAM + frozen_bytes, _device_memory(device)
    fits = need <= AUTO_DDP_FRACTION * have and section.replicate == 1 and not section.cpu_offload
    gib = f"{need / 2**30:.2f} GiB of training state vs {have / 2**30:.1f} GiB on {device.type}"
    if fits:
        choice = "ddp" if world_size > 1 else "none"
        return Plan(STRATEGIES[choice], f"auto: {gib} fits in {AUTO_DDP_FRACTION:.0%}, so {choice}", dtype)
    return Plan(STRATEGIES["fsdp2"], f"auto: {gib} does not fit in {AUTO_DDP_FRACTION:.0%}, so fsdp2", dtype)


def apply_activation_checkpointing(model: nn.Module) -> None:
    # transformers checkpoints each decoder layer itself; module names (and checkpoints) stay unchanged. A
    # recompute runs under its forward's sequence split (llmtrain.models.ulysses).
    # newer transformers 5.x call it activation_checkpointing_enable (the old name warns; its first argument,
    # the checkpoint's keyword arguments, renamed alike); older 5.x has the old name only
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False, "context_fn": ulysses.recompute_contexts})


def apply_compile(model: nn.Module) -> None:
    for layer in decoder_layers(model):
        layer.compile()


def _materialize_one(module: nn.Module, root: nn.Module, device: torch.device) -> None:
    """FSDP1 materializes unit by unit; once both embeddings are real, tie them again."""
    release_freed_memory()  # the previous unit's full-size tensors, dropped once it was sharded
    model_lib.materialize(module, device, recurse=False)
    inp, out = root.get_input_embeddings(), root.get_output_embeddings()
    if root.config.tie_word_embeddings and out is not None and not (inp.weight.is_meta or out.weight.is_meta):
        root.tie_weights()


def materialize(model: nn.Module, device: torch.device) -> None:
    """to_empty replaces meta parameters one by one, which unties tied embeddings: tie them again."""
    model_lib.materialize(model, device)
    model.tie_weights()


class Strategy:
    """One parallel strategy: its wrap and what differs per strategy after wrapping. The defaults are those of
    a model held whole on every rank (none, ddp); STRATEGIES maps each parallel.strategy name to its object."""
    name: str
    # Mixed precision through torch.autocast; FSDP casts parameters through its own policy instead.
    autocasts = True

    def wrap(self, model: nn.Module, section: ParallelConfig, dtype: torch.dtype, mesh: DeviceMesh,
             device: torch.device) -> nn.Module:
        """Meta-device model in, materialized (empty) wrapped model out."""
        materialize(model, device)
        return model

    def load(self, model: nn.Module, path: Path | None, config: PretrainedConfig, seed: int,
             adapters: dict[str, torch.Tensor] | None = None) -> None:
        """Fill the parallelized (empty) model from model.path (None: the seeded random init). Host RAM per rank
        is its shards plus one tensor in flight: each rank reads only its own slices (models.hf.load_slices).
        `adapters`: LoRA's {name: full tensor}, the same on every rank."""
        model_lib.load_slices(model, path, config, seed, adapters or {})
        release_freed_memory()

    def full_weights(self, model: nn.Module, device: torch.device,
                     trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """Collective (it gathers shards): the model's full state dict on rank 0's CPU ({} on other ranks)."""
        state = get_model_state_dict(model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=self.offloads_full_state(device), ignore_frozen_params=trainable_only))
        if trainable_only:
            state = without_frozen(model, state)
        return {k: v.detach().cpu() for k, v in state.items()} if dist.get_rank() == 0 else {}

    @contextlib.contextmanager
    def unsharded(self, model: nn.Module):
        """-> (module to call, lockstep): every weight gathered for the block when the strategy allows it
        (decoding: many small forwards); lockstep True when each forward is still collective (FSDP1), so every
        rank must run as many."""
        yield model, False

    def param_slots(self, model: nn.Module) -> dict[str, object]:
        """{clean name: the wrapper's hold on that parameter} for parameters a caller may swap after wrapping
        (models.nf4); {} when the wrapper keeps no such hold (setattr on the module is enough)."""
        return {}

    def reseat(self, slot: object, param: nn.Parameter, whole: bool) -> None:
        """After setattr put `param` in place of the parameter param_slots gave `slot` for: the wrapper holds
        `param` (whole: the rank holds all of it, nothing to gather)."""

    def describe(self, model: nn.Module) -> str:
        """What was wrapped, for the start-up log: e.g. `ddp: whole model (2 x LlamaDecoderLayer)`."""
        return f"{self.name}: whole model ({_blocks(model)})"

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Inside it, backward leaves gradients local (no all-reduce or reduce-scatter)."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Global gradient norm (clipped to max_norm when > 0), the same on every rank."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        return _clip(grads, norm, max_norm)

    def grad_scaler(self, device: torch.device):
        """The loss scaler fp16 needs."""
        return torch.amp.GradScaler(device.type)

    def offloads_full_state(self, device: torch.device) -> bool:
        """Whether full_weights gathers onto rank 0's CPU only (else every rank gathers a copy on the way)."""
        return True

    def frozen(self) -> Strategy:
        """The strategy for a frozen copy of the model (no gradients) next to this one."""
        return self

    def __repr__(self) -> str:
        return self.name


class Unwrapped(Strategy):
    name = "none"


class DDP(Strategy):
    name = "ddp"

    def wrap(self, model, section, dtype, mesh, device):
        from torch.nn.parallel import DistributedDataParallel

        materialize(model, device)
        # DDP broadcasts rank 0's (still uninitialised) parameters; load() then fills every rank alike. Gradients
        # as views of the all-reduce buckets: one gradient-sized copy less, in memory and in time per step.
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       gradient_as_bucket_view=True)

    @contextlib.contextmanager
    def unsharded(self, model):
        yield model.module, False  # DDP's forward would broadcast buffers at every step

    def no_sync(self, model):
        return model.no_sync()

    def frozen(self):
        return STRATEGIES["none"]  # whole on each rank: without gradients there is nothing to synchronise


class Sharded(Strategy):
    """FSDP1 and FSDP2: parameters, gradients and optimizer state sharded over the ranks of the mesh."""
    autocasts = False

    def describe(self, model):
        return f"{self.name}: {_blocks(model)} + root"

    def grad_scaler(self, device):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type)


class FSDP1(Sharded):
    name = "fsdp"

    def load(self, model, path, config, seed, adapters=None):
        # One gathered unit at a time: FSDP1's own sharded load_state_dict would hold a whole model per rank.
        model_lib.load_units(model, path, config, seed, adapters or {})
        release_freed_memory()

    def wrap(self, model, section, dtype, mesh, device):
        from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

        units = {id(m) for m in wrap_units(model)}  # each decoder layer (or a VLM's part) its own unit
        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in units)
        mp = None
        if dtype != torch.float32:
            mp = MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
        wrapped = FullyShardedDataParallel(
            model,
            auto_wrap_policy=policy,
            sharding_strategy=ShardingStrategy[section.sharding_strategy],
            mixed_precision=mp,
            cpu_offload=CPUOffload(offload_params=section.cpu_offload),
            device_id=device,  # needed on CPU too (measured: torch 2.13 otherwise fails to place shards)
            device_mesh=mesh,
            use_orig_params=True,
            # Materialize meta parameters empty (weights are loaded after wrapping), re-tying embeddings.
            param_init_fn=lambda m: _materialize_one(m, model, device),
            sync_module_states=False,
        )
        release_freed_memory()
        return wrapped

    @contextlib.contextmanager
    def unsharded(self, model):
        # FSDP1's forward gathers each unit at every step, even inside summon_full_params (its nested units still
        # all-gather: measured, a rank running more forwards than another hangs): lockstep.
        yield model, True

    def no_sync(self, model):
        return model.no_sync()

    def clip_grad_norm(self, model, max_norm):
        return model.clip_grad_norm_(_limit(max_norm))

    def offloads_full_state(self, device):
        return device.type != "cpu"  # cpu_offload on CPU segfaults rank 0 (torch 2.13): every rank keeps a copy

    def frozen(self):
        # FSDP1 frees its root unit's gathered parameters only in backward, which a frozen copy never runs: it
        # would hold the embeddings and output layer whole on every rank. FSDP2 on the same mesh does not.
        return FSDP2(trained=False)


class FSDP2(Sharded):
    name = "fsdp2"

    def __init__(self, trained: bool = True):
        # A trained model runs backward right after forward: its root (embeddings, final norm, output layer)
        # and last layer stay gathered for it (resharding them would all-gather them twice per micro-batch;
        # FSDP2's own default for a root). A frozen copy runs no backward: it reshards every unit after each
        # forward, or it would keep them gathered for the whole run.
        self.trained = trained

    def wrap(self, model, section, dtype, mesh, device):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        kwargs = dict(
            mesh=mesh,
            mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
            offload_policy=CPUOffloadPolicy() if section.cpu_offload else OffloadPolicy(),
        )
        layers = wrap_units(model)
        for i, layer in enumerate(layers):
            keep = self.trained and (i == len(layers) - 1 or not section.reshard_after_forward)
            fully_shard(layer, reshard_after_forward=not keep, **kwargs)
        fully_shard(model, reshard_after_forward=not self.trained, **kwargs)
        materialize(model, torch.device("cpu") if section.cpu_offload else device)
        return model

    def frozen(self):
        return FSDP2(trained=False)

    @contextlib.contextmanager
    def unsharded(self, model):
        # Every unit unsharded once and kept so across the forwards (decoding then runs no collective, so ranks
        # stop at their own last token): reshard_after_forward off for the block, then the units' own settings
        # back (FSDP2 offers a setter but no getter: its param groups hold them), resharded at the end.
        units = _fsdp2_units(model)
        saved = [(u._get_fsdp_state(), [(g, g.post_forward_mesh_info) for g in u._get_fsdp_state()._fsdp_param_groups])
                 for u in units]
        autos = [state._auto_reshard_after_forward for state, _ in saved]
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        try:
            yield model, False
        finally:
            for (state, groups), auto in zip(saved, autos):
                state._auto_reshard_after_forward = auto
                for group, info in groups:
                    group.post_forward_mesh_info = info
            for unit in units:
                unit.reshard()

    def param_slots(self, model):
        """{clean name: (FSDPParam, its FSDPParamGroup)} for the parameters fully_shard manages."""
        names = {id(m): n for n, m in model.named_modules()}
        out = {}
        for module in _fsdp2_units(model):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    owner, attr = names[id(fp._module_info.module)], fp._module_info.param_name
                    out[clean_name(f"{owner}.{attr}" if owner else attr)] = fp, group
        return out

    def reseat(self, slot, param, whole):
        fsdp_param, param_group = slot
        if whole:
            # A shard group of one rank (fsdp2 on 1 process, HSDP with parallel.replicate = world size) holds the
            # weight whole, with nothing to gather: torch 2.13's FSDP2 then copies the first all-gather input
            # only (FSDPParamGroup.wait_for_unshard's world-size-1 path), which breaks a tensor subclass with
            # several (NF4: data, scales, factors). Such a weight leaves FSDP2's management and stays a plain
            # tensor, as under none/ddp (frozen: no gradient to reduce).
            param_group.fsdp_params.remove(fsdp_param)
            return
        # FSDP2 learns a parameter's all-gather extension (fsdp_pre/post_all_gather) when fully_shard runs, on
        # the meta model, before the weights exist; torch 2.13 has no public way to change it afterwards. Point
        # it at the new shard (even: no padding) as reset_sharded_param would after load_state_dict(assign=True)
        # - which itself cannot compare an NF4 shard's storage - and find the hooks.
        fsdp_param.sharded_param = param
        fsdp_param._sharded_param_data = param.to_local().view(-1)
        fsdp_param._init_extensions()

    def no_sync(self, model):
        model.set_requires_gradient_sync(False)
        return _restore_sync(model)

    def clip_grad_norm(self, model, max_norm):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        layouts = {(g.device_mesh, g.placements) if isinstance(g, DTensor) else None for g in grads}
        if len(layouts) == 1 and None not in layouts:
            # Norms of the local shards, squared and summed over the mesh dims the gradients are sharded on
            # (one all-reduce); per-tensor DTensor dispatch cost more than the arithmetic (~1% of a demo step).
            mesh, placements = grads[0].device_mesh, grads[0].placements
            grads = [g.to_local() for g in grads]
            norm = torch.nn.utils.get_total_norm(grads, foreach=True) ** 2
            for dim, placement in enumerate(placements):
                if placement.is_shard():
                    dist.all_reduce(norm, group=mesh.get_group(dim))
            norm = norm.sqrt()
        else:
            norm = torch.nn.utils.get_total_norm(grads)
            if isinstance(norm, DTensor):  # DTensors on several meshes or placements: a DTensor of partial norms
                norm = norm.full_tensor()
        return _clip(grads, norm, max_norm)


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (Unwrapped(), DDP(), FSDP1(), FSDP2())}


def holding(model: nn.Module) -> Strategy:
    """The strategy whose wrapper holds `model` (for code handed a bare model: sampling, NF4)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return STRATEGIES["ddp"]
    if isinstance(model, FullyShardedDataParallel):
        return STRATEGIES["fsdp"]
    return STRATEGIES["fsdp2"] if _fsdp2_units(model) else STRATEGIES["none"]


def unsharded(model: nn.Module) -> contextlib.AbstractContextManager:
    """holding(model).unsharded(model): -> (module to call, lockstep) for decoding (Strategy.unsharded)."""
    return holding(model).unsharded(model)


def _fsdp2_units(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def without_frozen(model: nn.Module, state: dict) -> dict:
    """ignore_frozen_params drops a frozen parameter under one name only: a tied output embedding would
    still be saved under the other (torch 2.13)."""
    frozen = {clean_name(n) for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in state.items() if k not in frozen}


def _blocks(model: nn.Module) -> str:
    """`2 x LlamaDecoderLayer`; a vision-language model's blocks of both towers, `2 x CLIPEncoderLayer + 2 x ...`."""
    # fully_shard swaps a layer's class for a subclass FSDP<name> made in torch.distributed: name the model's.
    names = [next(c for c in type(layer).__mro__ if not c.__module__.startswith("torch.distributed")).__name__
             for layer in decoder_layers(model)]
    return " + ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names))


def _limit(max_norm: float) -> float:
    return max_norm if max_norm > 0 else float("inf")


def _clip(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    torch._foreach_mul_(grads, torch.clamp(_limit(max_norm) / (norm + 1e-6), max=1.0))
    return norm


@contextlib.contextmanager
def _restore_sync(model: nn.Module):
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def parallelize(model: nn.Module, section: ParallelConfig, plan: Plan, mesh: DeviceMesh,
                device: torch.device) -> nn.Module:
    """Meta-device model in, materialized (empty) wrapped model out; weights are loaded afterwards."""
    if section.activation_checkpointing:
        apply_activation_checkpointing(model)
    if section.compile:
        apply_compile(model)
    return plan.strategy.wrap(model, section, plan.dtype, mesh, device)


def grad_sync(model: nn.Module, plan: Plan, enabled: bool):
    """Skip the gradient all-reduce/reduce-scatter on non-final micro-batches."""
    return contextlib.nullcontext() if enabled else plan.strategy.no_sync(model)


def autocast(plan: Plan, device: torch.device):
    if not plan.autocast:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=plan.dtype)


def grad_scaler(plan: Plan, device: torch.device):
    """fp16 needs loss scaling; bf16 and fp32 do not."""
    return plan.strategy.grad_scaler(device) if plan.dtype == torch.float16 else None
