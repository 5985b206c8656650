"""Exports users load without llmtrain: the consolidated Hugging Face directory (safetensors + config +
generation config + tokenizer; `from_pretrained` reads it) and PEFT adapter directories. From a live model
(collective: every rank gathers, rank 0 writes) or from tensors already in memory (llmtrain.convert). Each is
written into `<dir>.tmp` and published by rename, so a reader never sees half of one. Nothing is pickled."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from torch import nn
from transformers import GenerationConfig

from llmtrain.config import LoraConfig
from llmtrain.models import lora, nf4
from llmtrain.models.hf import WEIGHTS_FILE, WEIGHTS_INDEX, stop_ids
from llmtrain.models.names import peft_key
from llmtrain.parallelize import Strategy
from llmtrain.utils import follow_umask, free_bytes, megabytes, no_space, publish

# The directories a LoRA export writes, by lora.export: adapter (PEFT) and/or hf (merged).
LORA_OUTPUTS = {"adapter": ("adapter",), "merged": ("hf",), "both": ("adapter", "hf")}
RETRY_S = 10.0  # between two tries of an export that did not fit (at most: a tenth of a shorter wait)


class ExportError(RuntimeError):
    """The export could not be written; every rank raises it with the same message."""
    collective = True


def _fresh(out: Path) -> Path:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def write_hf(state: dict[str, torch.Tensor], out: Path, config, tokenizer, dtype: torch.dtype,
             max_shard_size: str = "5GB", processor=None) -> None:
    """A directory that transformers' from_pretrained loads with no llmtrain import; a vision-language model's
    with its processor's files (processor and image-processor config, chat template, tokenizer)."""
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = {k: v.to(dtype).contiguous() for k, v in state.items()}
    tmp = _fresh(out)
    split = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n] for n in names}, tmp / filename, metadata={"format": "pt"})
        follow_umask(tmp / filename)
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": split.tensor_to_filename}
        (tmp / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2))
    else:
        assert (tmp / WEIGHTS_FILE).is_file()
    config = config.__class__.from_dict(config.to_dict())  # a copy: the live config stays as trained
    config.dtype = dtype
    config.use_cache = True
    config.save_pretrained(tmp)
    generation = GenerationConfig.from_model_config(config)
    # A chat-trained model ends its turn with the template's end-of-turn token: plain `generate` (and any
    # server reading generation_config.json) must stop there too, as Llama 3's own release lists both.
    stop = stop_ids(config.get_text_config().eos_token_id, tokenizer)
    generation.eos_token_id = stop if len(stop) > 1 else stop[0] if stop else None
    generation.save_pretrained(tmp)
    (processor or tokenizer).save_pretrained(tmp)
    publish(tmp, out, keep="step_*")  # the exports made during training stay


def write_adapter(trained: dict[str, torch.Tensor], out: Path, section: LoraConfig, base_path: str | None) -> None:
    """PEFT's layout (rank 0): adapter_config.json + adapter_model.safetensors. The config names the adapted
    modules one by one, as PEFT does after resolving all-linear."""
    tmp = _fresh(out)
    save_file({peft_key(n): t.float().contiguous() for n, t in trained.items()}, tmp / lora.ADAPTER_WEIGHTS,
              metadata={"format": "pt"})
    follow_umask(tmp / lora.ADAPTER_WEIGHTS)
    config = lora.peft_config(section)
    config.target_modules = sorted({n.split(".lora_A.")[0] for n in trained if ".lora_A." in n})
    config.base_model_name_or_path = base_path
    config.inference_mode = True
    config.save_pretrained(str(tmp))
    publish(tmp, out, keep="step_*")  # the exports made during training stay


def write_until_fits(write: Callable[[], None] | None, out: Path, size: int, wait_minutes: float) -> None:
    """Collective: rank 0 runs `write` (the other ranks pass None) until it fits. A full disk never loses the
    weights `write` holds in memory: the partial `<out>.tmp` goes, and rank 0 tries again every RETRY_S (a tenth of
    wait_minutes if that is shorter) while the user frees space, for up to wait_minutes; then every rank raises
    ExportError saying so. Every rank learns each try's outcome (a broadcast), so none dies waiting on a rank
    that failed."""
    deadline, warned, error = time.monotonic() + 60 * wait_minutes, False, None
    retry_s = min(RETRY_S, 6 * wait_minutes)
    while True:
        outcome = None  # None: written | "retry" | the message of a failure
        if write is not None:
            try:
                write()
            except Exception as e:
                shutil.rmtree(out.with_name(out.name + ".tmp"), ignore_errors=True)
                error = None if no_space(e) else e  # rank 0 raises it itself (its traceback), the others an ExportError
                outcome = _failed_try(e, out, size, wait_minutes, time.monotonic() < deadline)
                if outcome == "retry" and not warned:
                    warned = True
                    print(f"warning: no space left on device in {out.parent}: the export {out.name} needs about "
                          f"{megabytes(size)}, {megabytes(free_bytes(out))} free. The trained weights are kept in "
                          f"memory: free space there; retrying every {retry_s:g} s for up to {wait_minutes:g} "
                          "minutes (checkpoint.export_wait_minutes)", file=sys.stderr, flush=True)
        agreed = _agree([outcome])
        if agreed != "retry":
            break
        time.sleep(retry_s)  # every rank: none waits in a collective meanwhile
    if agreed is None:
        return
    if error is not None:
        raise error
    raise ExportError(agreed)


def _failed_try(e: Exception, out: Path, size: int, wait_minutes: float, can_wait: bool) -> str:
    """What a failed try of the export tells every rank: "retry" (the disk is full and there is time left) or
    the failure's message."""
    if not no_space(e):
        return f"the export to {out} failed on rank 0: {type(e).__name__}: {e}"[:500]
    if can_wait:
        return "retry"
    return (f"no space left on device in {out.parent}: the export {out.name} (about {megabytes(size)}) could not "
            f"be written ({megabytes(free_bytes(out))} free after waiting {wait_minutes:g} minutes, "
            f"checkpoint.export_wait_minutes); the partial {out.name}.tmp was removed")


def _agree(outcome: list) -> str | None:
    """Collective: rank 0's outcome of a try, on every rank."""
    dist.broadcast_object_list(outcome, src=0)
    # gloo's worker thread frees the broadcast's tensors after the call returns, taking the GIL: were the
    # process group torn down meanwhile (the run's end), its destructor would wait for that thread while
    # holding the GIL (a deadlock, seen at torch 2.13). A barrier (no Python tensors) lets it finish first.
    dist.barrier()
    return outcome[0]


def hf_state(model: nn.Module, strategy: Strategy, device: torch.device,
             lora_section: LoraConfig | None = None) -> dict[str, torch.Tensor]:
    """Collective: the model by its Hugging Face names, on rank 0's CPU ({} on the other ranks); with
    lora_section (enabled), the adapters merged into the base (a QLoRA base dequantized first)."""
    state = strategy.full_weights(model, device)
    if lora_section is None or not state:
        return state
    return lora.merged_state({k: nf4.dequantized(v) for k, v in state.items()}, lora_section)


def _bytes(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> int:
    return sum(t.numel() * (dtype.itemsize if dtype else t.element_size()) for t in state.values())


def export_hf(model: nn.Module, strategy: Strategy, device: torch.device, out: str | Path, config, tokenizer,
              dtype: torch.dtype = torch.float32, max_shard_size: str = "5GB", wait_minutes: float = 0.0,
              processor=None) -> None:
    """Collective: all ranks gather, rank 0 writes (see `write_until_fits`), all ranks learn the outcome."""
    state, out = hf_state(model, strategy, device), Path(out)
    main = dist.get_rank() == 0
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()  # written once (write_hf)
    write = (lambda: write_hf(dict(state), out, config, tokenizer, dtype, max_shard_size, processor)) if main else None
    write_until_fits(write, out, _bytes({k: v for k, v in state.items() if k not in tied}, dtype), wait_minutes)


def export_lora(model: nn.Module, strategy: Strategy, device: torch.device, output_dir: Path, step_dir: str,
                section: LoraConfig, base_path: str | None, model_config, tokenizer, dtype: torch.dtype,
                max_shard_size: str, wait_minutes: float = 0.0, processor=None) -> list[Path]:
    """Collective. output_dir/adapter[/step_dir] (PEFT) and/or output_dir/hf[/step_dir] (merged, with a
    vision-language model's processor files), as lora.export says; returns what was written."""
    written_dirs, main = [], dist.get_rank() == 0
    if "adapter" in LORA_OUTPUTS[section.export]:
        adapters = strategy.full_weights(model, device, trainable_only=True)
        out = output_dir / "adapter" / step_dir
        write_until_fits((lambda: write_adapter(adapters, out, section, base_path)) if main else None, out,
                         _bytes(adapters, torch.float32), wait_minutes)
        written_dirs.append(out)
    if "hf" in LORA_OUTPUTS[section.export]:
        state = hf_state(model, strategy, device, section)
        out = output_dir / "hf" / step_dir
        write = (lambda: write_hf(dict(state), out, model_config, tokenizer, dtype, max_shard_size, processor)) \
            if main else None
        write_until_fits(write, out, _bytes(state, dtype), wait_minutes)
        written_dirs.append(out)
    return written_dirs
