"""QLoRA's frozen base in 4-bit NF4 (torchao's NF4Tensor), as a converter of a LoRA model.

Which weights (plan): every frozen linear weight inside the decoder blocks (LoRA's `base_layer`s, the block
linears LoRA does not target, modules_to_save originals; a vision-language model's language model only: its
vision tower and projector stay exact); never embeddings, norms, biases or the output layer, which stay in
lora.base_dtype. It depends only on the model's shapes and the lora settings, never on the
strategy or world size, so runs stay comparable across them.

Format (QLoRA's, torchtune's defaults): one absmax scale per lora.nf4_block_size (64) weights, and those
scales double-quantized to int8 in groups of lora.nf4_scaler_block_size (256) with one fp32 factor per group:
4 + 8/64 + 32/(64*256) = 4.127 bits per weight, 0.258x of bf16. A weight whose size is not a multiple of the
block size stays unquantized (logged by name); one whose number of blocks is not a multiple of the scaler
block gets the largest scaler group that divides it (gcd; logged) - still a function of the shape alone.

When (quantize_): after the weights are loaded, weight by weight, each rank quantizing the tensor it holds
(whole under none/ddp, its Shard(0) piece under fsdp2), its full-precision copy freed before the next: the
host peak stays that of the loaded LoRA model plus one weight's temporaries. A quantized shard equals that
rows' slice of the whole weight's quantization, bit for bit: block scales are local, and the double
quantization (the scales' mean and each group's factor) is computed from all of the weight's block scales,
gathered over the shard group (1/64 of the weight's elements). torchao's FSDP2 all-gather hooks
(fsdp_pre/post_all_gather) then gather the 4-bit data and scales, never a dequantized weight.

FSDP2 shards that do not divide: the local piece must hold whole blocks and the same number of rows on every
rank; its scales must form whole scaler groups. When the groups straddle ranks (704 x 256 on 2 ranks: 11 groups
of 256 scales), the shard is stored with a finer scaler group (gcd with its number of blocks) whose int8
scales and fp32 factors are the whole weight's, the factor repeated: the same values as under none/ddp, a few
more fp32 factors. Only rows or blocks that do not split evenly over the ranks (a weight of 30 rows on 4 ranks)
leave that weight in full precision on that run, with a warning naming it: 2-D weights of real models split.
A shard group of one rank (fsdp2 on one process, HSDP with one shard per replica) holds its weights whole
outside FSDP2 (Strategy.reseat: torch 2.13's one-rank unshard copies one all-gather input, NF4 has three).

Why torchao and not bitsandbytes: NF4Tensor is plain PyTorch (the CPU tests run the GPU code path), it
implements FSDP2's all-gather extension and shards as a DTensor whose local piece stays 4-bit; bitsandbytes'
Params4bit keeps its quant_state outside the tensor, which FSDP2's sharded state dict loses. FSDP1 flattens
parameters into one buffer, which a tensor subclass cannot join: refused (check)."""

from __future__ import annotations

import importlib
import logging
import math
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from llmtrain import parallelize
from llmtrain.config import ConfigError, LoraConfig
from llmtrain.models import vision
from llmtrain.models.hf import decoder_layers
from llmtrain.models.names import base_name, clean_name
from llmtrain.utils import release_freed_memory

log = logging.getLogger(__name__)
INSTALL = "pip install 'llmtrain[qlora]'"
AO_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
CHUNK = 1 << 20  # elements quantized at once


def _torchao():
    """torchao's NF4 module (torchao >= 0.18 moved it to torchao.quantization)."""
    try:
        return importlib.import_module(AO_MODULE)
    except ImportError:
        raise ConfigError(f"lora.quantize_base=nf4 needs torchao >= 0.18: {INSTALL}") from None


def check(section: LoraConfig, strategy_name: str) -> None:
    """Set-up errors, before any process group: nf4 needs LoRA, torchao and a strategy other than fsdp."""
    if section.quantize_base == "none":
        return
    if not section.enabled:
        raise ConfigError("lora.quantize_base=nf4 quantizes LoRA's frozen base: set lora.enabled=true")
    if strategy_name == "fsdp":
        raise ConfigError("lora.quantize_base=nf4 does not work with parallel.strategy=fsdp (FSDP1 flattens "
                          "parameters, which a 4-bit tensor subclass cannot join); use parallel.strategy=fsdp2")
    if section.nf4_block_size % 2:  # two 4-bit codes per byte (the range is config's)
        raise ConfigError(f"lora.nf4_block_size={section.nf4_block_size} must be even")
    _torchao()


@dataclass(frozen=True)
class Plan:
    """plan(): {clean parameter name: its scaler group size} to quantize, and {name: why not} for the
    decoder blocks' linear weights left in full precision."""
    quantized: dict[str, int]
    skipped: dict[str, str]


def plan(model: nn.Module, section: LoraConfig) -> Plan:
    """Which weights nf4 quantizes, from the shapes alone (the meta model, or the same model wrapped)."""
    quantized, skipped = {}, {}
    if section.quantize_base != "nf4":
        return Plan(quantized, skipped)
    block, scaler = section.nf4_block_size, section.nf4_scaler_block_size
    for name, p in _block_linear_weights(model).items():
        if p.requires_grad:
            continue  # modules_to_save copies train in full precision
        if p.numel() % block:
            skipped[name] = f"{tuple(p.shape)} is not a multiple of lora.nf4_block_size={block}"
            continue
        quantized[name] = math.gcd(p.numel() // block, scaler)
    return Plan(quantized, skipped)


def _block_linear_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """{clean name: weight} of the 2-D linear weights inside the decoder blocks (a vision-language model's
    language model only: its vision tower stays exact)."""
    layers = vision.language_layers(model) if vision.wraps_vision(model) else decoder_layers(model)
    inside = {id(m) for layer in layers for m in layer.modules()}
    return {clean_name(f"{name}.weight" if name else "weight"): m.weight for name, m in model.named_modules()
            if id(m) in inside and isinstance(m, nn.Linear) and m.weight.dim() == 2}


@dataclass
class Report:
    """What quantize_ did, for the start-up log: bytes per rank of the quantized weights before (as bf16)
    and after (NF4 data + scales), and the weights left in full precision with the reason."""
    weights: int = 0
    params: int = 0
    nf4_bytes: int = 0
    bf16_bytes: int = 0
    finer_groups: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        ratio = self.nf4_bytes / self.bf16_bytes if self.bf16_bytes else 0.0
        line = (f"nf4: {self.weights} block linear weights ({self.params / 1e6:.2f}M parameters) at "
                f"{self.nf4_bytes / 2**20:.2f} MiB per rank with scales vs {self.bf16_bytes / 2**20:.2f} MiB in bf16 "
                f"({ratio:.3f}x); embeddings, norms and the output layer stay in lora.base_dtype")
        if self.finer_groups:
            line += f"; {len(self.finer_groups)} fsdp2 shards store finer scaler groups (same values)"
        if self.skipped:
            line += f"; {len(self.skipped)} left in full precision: " + "; ".join(
                f"{n} ({why})" for n, why in list(self.skipped.items())[:4])
        return line


def quantize_(model: nn.Module, section: LoraConfig) -> Report:
    """Collective under fsdp2. Replace the planned weights of the loaded model (none, ddp: whole tensors;
    fsdp2: Shard(0) DTensors) by NF4, one at a time, in place. Call after loading and after the NaN check
    (which cannot read NF4), before the optimizer is built."""
    chosen = plan(model, section)
    report = Report(skipped=dict(chosen.skipped))
    if not chosen.quantized:
        return report
    owners = _owners(model)
    strategy = parallelize.holding(model)
    slots = strategy.param_slots(model)  # fsdp2: its hold on each parameter, pointed at the NF4 one below
    for name, scaler in chosen.quantized.items():
        module, attr = owners[name]
        weight = getattr(module, attr)
        local = weight.to_local() if isinstance(weight, DTensor) else weight.detach()
        group, why = _shard_group(weight, section.nf4_block_size)
        if why:
            report.skipped[name] = why
            log.warning("nf4: %s stays in %s on this run: %s", name, local.dtype, why)
            continue
        alone = group is not None and dist.get_world_size(group) == 1
        q = _quantize_local(local, section.nf4_block_size, scaler, None if alone else group)
        if q.scaler_block_size != scaler:
            report.finer_groups[name] = q.scaler_block_size
        if isinstance(weight, DTensor) and not alone:
            new = DTensor(local_tensor=q, spec=weight._spec, requires_grad=False)
        else:
            new = q
        param = nn.Parameter(new, requires_grad=False)
        setattr(module, attr, param)
        if name in slots:
            strategy.reseat(slots[name], param, whole=alone)
        del weight, local
        report.weights += 1
        report.params += q.numel()
        report.nf4_bytes += nbytes(q)
        report.bf16_bytes += 2 * q.numel()
    release_freed_memory()
    return report


def _owners(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    return {clean_name(f"{mod_name}.{attr}" if mod_name else attr): (module, attr)
            for mod_name, module in model.named_modules() for attr, _ in module.named_parameters(recurse=False)}


def _shard_group(weight: torch.Tensor, block: int) -> tuple[dist.ProcessGroup | None, str]:
    """The process group a weight's rows are sharded over (None: held whole), or why its shard cannot be NF4."""
    if not isinstance(weight, DTensor):
        return None, ""
    shard_dims = [i for i, p in enumerate(weight.placements) if p.is_shard()]
    if len(shard_dims) != 1 or weight.placements[shard_dims[0]].dim != 0:
        return None, f"placements {weight.placements} (expected rows sharded over one mesh dimension)"
    group = weight.device_mesh.get_group(shard_dims[0])
    ranks = dist.get_world_size(group)
    rows, cols = weight.shape
    if rows % ranks or (rows // ranks * cols) % block:
        return None, (f"fsdp2 shards of {tuple(weight.shape)} over {ranks} ranks are not whole rows of whole "
                      f"{block}-blocks (parallel.strategy none/ddp, or another world size, quantize it)")
    return group, ""


def _quantize_local(local: torch.Tensor, block: int, scaler: int, group: dist.ProcessGroup | None):
    """NF4 of `local`, the whole weight or the rank's rows of it: the whole weight's quantization, restricted
    to these rows. Double quantization goes through torchao's own function on the gathered block scales
    (block size 1 makes its per-block absmax the identity), so the values equal torchao's to_nf4."""
    ao = _torchao()
    local = local.contiguous()
    n_local = local.numel() // block
    absmax = ao.get_block_absmax(local.flatten(), block)
    if group is None:
        everyone, first = absmax, 0
    else:
        parts = [torch.empty_like(absmax) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, absmax, group=group)
        everyone, first = torch.cat(parts), dist.get_rank(group) * n_local
    scalers, factors, mean = ao.NF4Tensor.double_quantize_scalers(everyone, 1, scaler)
    # The shard's scales are whole groups of `stored` (a divisor of `scaler`), each inside one group of the
    # whole weight's: store that group's factor once per stored group.
    stored = math.gcd(scaler, n_local)
    factors = factors.repeat_interleave(scaler // stored)[first // stored:(first + n_local) // stored]
    lut = _lut(local)
    # The 4-bit codes chunk by chunk: torchao's conversion of a whole weight holds a scaled full-precision copy
    # and a byte per element at once, a transient the unquantized run never has. Each is torchao's choice, the
    # smallest |x - code| in x's dtype (the first on a tie), compared over the two codes around x only (the
    # others are further by a code gap): 5x faster on CPU than over all 16. An all-zero block scales to 0/0:
    # code 0.0, where torchao's code would come from NaN.
    flat, data = local.flatten(), torch.empty(local.numel() // 2, dtype=torch.uint8, device=local.device)
    step = block * max(1, CHUNK // block)
    for start in range(0, flat.numel(), step):
        blocks = flat[start:start + step].view(-1, block)
        x = torch.nan_to_num(blocks / ao.get_block_absmax(blocks.flatten(), block).unsqueeze(-1), 0.0).flatten()
        below = (torch.bucketize(x, lut) - 1).clamp_(0, len(lut) - 2)
        codes = torch.where((x - lut[below + 1]).abs() < (x - lut[below]).abs(), below + 1, below).to(torch.uint8)
        data[start // 2:(start + codes.numel()) // 2] = codes[::2] << 4 | codes[1::2]
    meta = ao.SubclassTensorArgs(local.size(), local.stride(), local.storage_offset(), local.dtype, local.device,
                                 False)
    return ao.NF4Tensor(meta, block, n_local, stored, scalers[first:first + n_local].clone(), factors.contiguous(),
                        mean, data, lut)


def _lut(like: torch.Tensor) -> torch.Tensor:
    """The 16 NF4 code values, as torchao builds them (a 2-element quantization keeps only its table)."""
    return _torchao().to_nf4(torch.ones(2, dtype=like.dtype, device=like.device), 2, 1).nf4


def nbytes(t: torch.Tensor) -> int:
    """Storage of a tensor: NF4 data + int8 scales + fp32 factors + mean for an NF4Tensor (local piece)."""
    ao = _torchao()
    if isinstance(t, DTensor):
        t = t.to_local()
    if isinstance(t, ao.NF4Tensor):
        return sum(x.numel() * x.element_size() for x in (t.quantized_data, t.quantized_scalers,
                                                           t.quantization_factor, t.scaler_mean))
    return t.numel() * t.element_size()


def is_nf4(t: torch.Tensor) -> bool:
    """An NF4Tensor, or a DTensor whose local piece is one (without torchao imported, there are none)."""
    ao = sys.modules.get(AO_MODULE)
    return ao is not None and isinstance(t.to_local() if isinstance(t, DTensor) else t, ao.NF4Tensor)


def dequantized(w: torch.Tensor) -> torch.Tensor:
    """A weight in its original dtype for export and merge: an NF4Tensor dequantized; an NF4 DTensor shard
    dequantized into a DTensor of the same placement (gather it as any other); anything else unchanged."""
    if isinstance(w, DTensor) and is_nf4(w):
        return DTensor.from_local(w.to_local().get_original_weight(), w.device_mesh, w.placements,
                                  shape=w.shape, stride=w.stride())
    if is_nf4(w):
        return w.get_original_weight()
    return w


def round_trip(weights: dict[str, torch.Tensor], model: nn.Module, section: LoraConfig) -> dict[str, torch.Tensor]:
    """model.path's weights ({base name: tensor}, as loaded) as a QLoRA run of `model` (the LoRA meta model)
    computes with them: each planned weight cast to lora.base_dtype, quantized and dequantized (convert's merge
    onto the base gives what the run's own merged export gives)."""
    dtype = torch.bfloat16 if section.base_dtype == "bf16" else torch.float32
    out = dict(weights)
    for name, scaler in plan(model, section).quantized.items():
        key = base_name(name)
        out[key] = _quantize_local(out[key].to(dtype), section.nf4_block_size, scaler, None).get_original_weight()
    return out
