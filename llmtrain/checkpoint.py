"""Everything saved. CheckpointManager owns the sharded training checkpoints (DCP: model, optimizer;
JSON: step, data cursor, per-rank RNG; the resolved config), published atomically by rename. The
consolidated Hugging Face export: rank 0 receives the full state dict on CPU tensor by tensor and
writes safetensors + config + tokenizer into a temporary directory, also published by rename.

Layout of output_dir/checkpoints/step_<N>/ (complete once renamed from step_<N>.tmp):
    .metadata, __*_*.distcp   DCP shards: {"model": ..., "optim": ...}
    manifest.json             size and xxh3_64 hash of every other file, checked before a resume
    trainer_state.json        step, samples_seen, tokens_seen, global_batch, world_size, ... (written last)
    rng_rank<R>.json          per-rank RNG states
    config.yaml               the llmtrain config of the run
    hf_config/                model config + tokenizer, so the offline converter needs nothing else
"""

from __future__ import annotations

import base64
import json
import sys
from concurrent.futures import ThreadPoolExecutor
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from llmtrain.config import CheckpointConfig, ConfigError
from llmtrain.models.hf import WEIGHTS_FILE, WEIGHTS_INDEX, clean_name

if TYPE_CHECKING:
    from llmtrain.parallelize import Strategy

STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
HASH = "xxh3_64"
HF_CONFIG_DIR = "hf_config"
# DCP's load fails on any key of these missing from the checkpoint, so set_state_dict may be non-strict.
SAVED = StateDictOptions(ignore_frozen_params=True)


def full_state_dict(model: nn.Module, strategy: Strategy, device: torch.device,
                    trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Every rank must call this (it gathers shards); the tensors are on rank 0's CPU (the strategy may have
    every rank gather a copy on the way, Strategy.offloads_full_state)."""
    offload = strategy.offloads_full_state(device)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=offload,
                                                                 ignore_frozen_params=trainable_only))
    if trainable_only:
        state = without_frozen(model, state)
    return {k: v.detach().cpu() for k, v in state.items()} if dist.get_rank() == 0 else {}


def without_frozen(model: nn.Module, state: dict) -> dict:
    """ignore_frozen_params drops a frozen parameter under one name only: a tied output embedding would
    still be saved under the other (torch 2.13)."""
    frozen = {clean_name(n) for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in state.items() if k not in frozen}


def publish(tmp: Path, final: Path) -> None:
    """Replace `final` by the complete `tmp`: a reader sees the old or the new directory, never half."""
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        for sub in final.glob("step_*"):  # keep the exports made during training (hf/step_<N>)
            sub.rename(tmp / sub.name)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def write_hf(state: dict[str, torch.Tensor], out: Path, config, tokenizer, dtype: torch.dtype,
             max_shard_size: str = "5GB") -> None:
    """A directory that transformers' from_pretrained loads with no llmtrain import. Never pickles."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = {k: v.to(dtype).contiguous() for k, v in state.items()}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    split = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n] for n in names}, tmp / filename, metadata={"format": "pt"})
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
    GenerationConfig.from_model_config(config).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    publish(tmp, out)


def export_hf(model: nn.Module, strategy: Strategy, device: torch.device, out: str | Path, config, tokenizer,
              dtype: torch.dtype = torch.float32, max_shard_size: str = "5GB") -> None:
    """Collective: all ranks gather, rank 0 writes, all ranks wait until the export is complete."""
    state = full_state_dict(model, strategy, device)
    if dist.get_rank() == 0:
        write_hf(state, Path(out), config, tokenizer, dtype, max_shard_size)
    dist.barrier()


@dataclass
class TrainState:
    """The non-tensor training state; `data` is the data position that make_steps resumes from."""
    step: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    global_batch: int = 0
    world_size: int = 0
    data: dict = field(default_factory=dict)  # the data position (llmtrain.data make_steps)
    base: dict = field(default_factory=dict)  # LoRA: the frozen base's path and fingerprint (llmtrain.models.lora)


def _rng_state() -> dict:
    import numpy as np

    enc = lambda t: base64.b64encode(t.numpy().tobytes()).decode()  # noqa: E731
    state = {"python": repr(random.getstate()), "torch": enc(torch.get_rng_state()),
             "numpy": repr(np.random.get_state(legacy=False))}
    if torch.cuda.is_available():
        state["cuda"] = enc(torch.cuda.get_rng_state())
    return state


def _set_rng_state(state: dict) -> None:
    import ast

    import numpy as np

    dec = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)  # noqa: E731
    random.setstate(ast.literal_eval(state["python"]))
    torch.set_rng_state(dec(state["torch"]))
    np_state = state["numpy"].replace("array(", "(").replace(", dtype=uint32)", ")")
    np.random.set_state(ast.literal_eval(np_state))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(dec(state["cuda"]))


def is_complete(path: Path) -> bool:
    """trainer_state.json is written last, after every rank's shards and DCP's .metadata."""
    return (path / STATE_FILE).is_file() and (path / ".metadata").is_file()


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of complete checkpoints, oldest first. A `.tmp` directory (a save that never
    finished) or one without trainer_state.json is never taken for a checkpoint."""
    found = []
    if root.is_dir():
        for p in root.iterdir():
            m = STEP_DIR.match(p.name)
            if m and is_complete(p):
                found.append((int(m.group(1)), p))
    return sorted(found)


def file_digest(path: Path) -> dict:
    """Size and a fast non-cryptographic hash (xxh3_64, several GB/s) of one file, read in 16 MiB blocks."""
    import xxhash

    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            h.update(block)
    return {"size": path.stat().st_size, HASH: h.hexdigest()}


def digests(root: Path, names: list[str]) -> dict[str, dict]:
    return {name: file_digest(root / name) for name in names}


def own_files(root: Path, rank: int) -> list[str]:
    """The files this rank wrote into a checkpoint: its DCP shards (__<rank>_<i>.distcp) and RNG state."""
    return sorted([p.name for p in root.glob(f"__{rank}_*.distcp")] + [f"rng_rank{rank}.json"])


def verify(path: Path) -> list[str]:
    """Collective when a process group exists: what is wrong with checkpoint `path` ([] if nothing); every
    rank gets the same list. Each rank checks every world_size-th file of the manifest (size, then hash), so
    the reading is shared."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problems = []
    if not (path / ".metadata").is_file():
        problems.append("no .metadata (DCP's index of the shards): the save did not finish")
    elif not (path / STATE_FILE).is_file():
        problems.append(f"no {STATE_FILE} (the completion marker): the save did not finish")
    elif (path / MANIFEST).is_file():
        try:
            files = sorted(json.loads((path / MANIFEST).read_text())["files"].items())
        except (ValueError, KeyError) as e:
            files, problems = [], [f"{MANIFEST} is unreadable ({e})"]
        for name, want in files[rank::world]:
            file = path / name
            if not file.is_file():
                problems.append(f"{name} is missing")
            elif file.stat().st_size != want["size"]:
                problems.append(f"{name} is {file.stat().st_size} bytes, {want['size']} when saved (truncated?)")
            elif file_digest(file)[HASH] != want[HASH]:
                problems.append(f"{name} has changed since it was saved ({HASH} differs)")
    gathered: list[list[str]] = [problems] * world
    if dist.is_initialized():
        dist.all_gather_object(gathered, problems)
    return sorted({p for ps in gathered for p in ps})


def _warn(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def _set_aside(path: Path) -> Path:
    """Rename a skipped checkpoint out of the step_<N> namespace: kept for inspection, never loaded, counted,
    pruned or overwritten by a new save of the same step."""
    aside = path.with_name(path.name + ".corrupt")
    n = 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}.corrupt{n}"), n + 1
    path.rename(aside)
    return aside


def _unverified_warning(path: Path) -> Path:
    if not (path / MANIFEST).is_file():
        _warn(f"{path} has no {MANIFEST} (saved by an older llmtrain): resuming from it unverified")
    return path


def choose_resume(section: CheckpointConfig, output_dir: str | Path) -> Path | None:
    """Collective: the verified checkpoint to resume from, or None to start fresh. resume=auto skips (with a
    warning) every newer checkpoint that fails verification and sets it aside as step_<N>.corrupt; an explicit
    path that fails is an error."""
    if section.resume == "never":
        return None
    if section.resume != "auto":
        path = Path(section.resume)
        if problems := verify(path):
            raise ConfigError(f"checkpoint.resume: {path} fails verification: {'; '.join(problems[:3])}; use "
                              "another checkpoint (or checkpoint.resume=auto to take the newest intact one)")
        return _unverified_warning(path)
    root = Path(output_dir) / "checkpoints"
    candidates = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))) \
        if root.is_dir() else []
    for _, path in reversed(candidates):
        problems = verify(path)
        if not problems:
            return _unverified_warning(path)
        aside = None
        if dist.get_rank() == 0:
            aside = _set_aside(path)
        dist.barrier()  # set aside before any rank lists the directory again
        _warn(f"skipping checkpoint {path}: {'; '.join(problems[:3])}. It is kept as {aside}; resuming from the "
              "newest intact checkpoint instead")
    return None


def check_writable(output_dir: str) -> None:
    """Fail before training when output_dir cannot be written (a file in the way, read-only, full)."""
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output_dir: {output_dir} is a file, not a directory; point output_dir at a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_test_{time.time_ns()}"
        probe.write_bytes(b"\0" * 4096)
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"output_dir: cannot write to {output_dir}: {e.strerror or e}") from None


def check_resume(section: CheckpointConfig) -> None:
    """Before any process group: a checkpoint.resume path names a complete checkpoint (choose_resume then
    verifies it, collectively)."""
    if section.resume not in ("auto", "never") and not is_complete(Path(section.resume)):
        raise ConfigError(f"checkpoint.resume: {section.resume} is not a complete checkpoint "
                          f"(no {STATE_FILE} or .metadata); use auto, never or a checkpoints/step_<N> path")


class SaveError(RuntimeError):
    def __init__(self, tmp: Path, cause: Exception):
        super().__init__(f"saving checkpoint {tmp.name.removesuffix('.tmp')} failed: {cause}. "
                         f"The partial save stays in {tmp} (never loaded); earlier checkpoints are intact.")


class CheckpointManager:
    """Owns every saved piece of training state. save() and resume() are collectives."""

    def __init__(self, section: CheckpointConfig, output_dir: str, model: nn.Module, optimizer, rank: int,
                 config_yaml: str, model_config, tokenizer):
        self.section = section
        self.root = Path(output_dir) / "checkpoints"
        self.model, self.optimizer, self.rank = model, optimizer, rank
        self.config_yaml, self.model_config, self.tokenizer = config_yaml, model_config, tokenizer
        self.pending = None  # (future of this rank's file digests, tmp dir, final dir, state) of an async save
        self.hasher = ThreadPoolExecutor(max_workers=1)  # async saves: the digests are taken off the training thread
        self.last_save = time.monotonic()

    # -- what to save -------------------------------------------------------------------------------
    def _tensors(self) -> dict:
        # Frozen parameters (a LoRA base) are not saved: a resume reads them from model.path again.
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=SAVED)
        return {"model": without_frozen(self.model, model_sd), "optim": optim_sd}

    def due(self, step: int, timer_fired: bool) -> bool:
        every = self.section.every_steps
        return (every > 0 and step % every == 0) or timer_fired

    def timer_fired(self) -> bool:
        """This rank's view; the recipe all-reduces it so that every rank agrees."""
        minutes = self.section.every_minutes
        return minutes > 0 and time.monotonic() - self.last_save >= 60 * minutes

    # -- save ---------------------------------------------------------------------------------------
    def save(self, state: TrainState) -> Path:
        """Write step_<N>.tmp on every rank, then publish it as step_<N> by rename (rank 0)."""
        self.wait()  # one save in flight at a time
        final = self.root / f"step_{state.step}"
        tmp = final.with_name(final.name + ".tmp")
        try:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            dist.barrier()
            (tmp / f"rng_rank{self.rank}.json").write_text(json.dumps(_rng_state()))
            if self.section.async_:
                future = dcp.async_save(self._tensors(), checkpoint_id=str(tmp))
                hashed = self.hasher.submit(lambda: (future.result(), digests(tmp, own_files(tmp, self.rank)))[1])
                self.pending = (hashed, tmp, final, state)
            else:
                dcp.save(self._tensors(), checkpoint_id=str(tmp))
                self._publish(tmp, final, state, digests(tmp, own_files(tmp, self.rank)))
        except (OSError, dcp.api.CheckpointException) as e:
            raise SaveError(tmp, e) from e
        self.last_save = time.monotonic()
        return final

    def poll(self) -> None:
        """Publish a finished async save; every rank calls this once per step (one tiny all-reduce)."""
        if self.pending is None:
            return
        done = torch.tensor([int(self.pending[0].done())])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item():
            self.wait()

    def wait(self) -> None:
        if self.pending is None:
            return
        hashed, tmp, final, state = self.pending
        self.pending = None
        try:
            self._publish(tmp, final, state, hashed.result())
        except (OSError, dcp.api.CheckpointException) as e:
            raise SaveError(tmp, e) from e

    def _publish(self, tmp: Path, final: Path, state: TrainState, own: dict[str, dict]) -> None:
        """Collective. The manifest gathers every rank's digests of its own files; rank 0 adds the rest."""
        gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(gathered, own)  # also the barrier: every rank's shards are written
        if self.rank == 0:
            (tmp / "config.yaml").write_text(self.config_yaml)
            self.model_config.save_pretrained(tmp / HF_CONFIG_DIR)
            self.tokenizer.save_pretrained(tmp / HF_CONFIG_DIR)
            files = {name: d for g in gathered for name, d in g.items()}
            rest = [str(p.relative_to(tmp)) for p in sorted(tmp.rglob("*")) if p.is_file()]
            files.update(digests(tmp, [n for n in rest if n not in files]))
            (tmp / MANIFEST).write_text(json.dumps({"files": files}, indent=1))
            (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))  # the completion marker
            if final.exists():  # the same step saved again (e.g. a resumed run): replace it
                shutil.rmtree(final)
            tmp.rename(final)
            self._prune()
        dist.barrier()

    def _prune(self) -> None:
        """Only after a newer checkpoint is complete do the old ones go."""
        keep = self.section.keep_last
        if keep > 0:
            for _, path in complete_checkpoints(self.root)[:-keep]:
                shutil.rmtree(path, ignore_errors=True)

    # -- resume -------------------------------------------------------------------------------------
    def resume(self, path: Path | None) -> TrainState | None:
        """Load checkpoint `path` (choose_resume's choice) into model and optimizer (DCP reshards to this
        world size and strategy); returns its TrainState, or None to start fresh."""
        if path is None:
            return None
        tensors = self._tensors()
        try:
            dcp.load(tensors, checkpoint_id=str(path))
        except dcp.api.CheckpointException as e:
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise ConfigError(f"checkpoint {path} cannot be loaded ({first}): move it away, or set "
                              "checkpoint.resume to another checkpoint") from None
        set_state_dict(self.model, self.optimizer, model_state_dict=tensors["model"],
                       optim_state_dict=tensors["optim"], options=StateDictOptions(ignore_frozen_params=True,
                                                                                    strict=False))
        state = TrainState(**json.loads((path / STATE_FILE).read_text()))
        rng = path / f"rng_rank{self.rank}.json"
        if state.world_size == dist.get_world_size() and rng.is_file():
            _set_rng_state(json.loads(rng.read_text()))
        return state
