"""Training checkpoints (DCP only; the Hugging Face and PEFT exports are llmtrain.export). CheckpointManager
saves, verifies and resumes every piece of training state: model and optimizer (DCP), the TrainState (step,
data cursor, ...), per-rank RNG, and any stateful object a recipe registers (`register`); published
atomically by rename.

Layout of output_dir/checkpoints/step_<N>/ (complete once renamed from step_<N>.tmp):
    .metadata, __*_*.distcp   DCP shards: {"model": ..., "optim": ...}
    manifest.json             size and xxh3_64 hash of every other file, checked before a resume
    trainer_state.json        step, samples_seen, tokens_seen, global_batch, world_size, ... (written last)
    rng_rank<R>.json          per-rank RNG states
    state/<name>.json         a registered object's state (state/<name>_rank<R>.json: one per rank)
    config.yaml               the llmtrain config of the run
    hf_config/                model config + tokenizer, so the offline converter needs nothing else
"""

from __future__ import annotations

import base64
import copy
import json
import sys
from concurrent.futures import ThreadPoolExecutor
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from llmtrain.config import CheckpointConfig, ConfigError
from llmtrain.parallelize import without_frozen
from llmtrain.utils import free_bytes, megabytes, no_space

STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
HASH = "xxh3_64"
HF_CONFIG_DIR = "hf_config"
STATE_DIR = "state"  # registered objects' JSON
# DCP's load fails on any key of these missing from the checkpoint, so set_state_dict may be non-strict.
SAVED = StateDictOptions(ignore_frozen_params=True)
ADAM_STATES = 2  # AdamW keeps exp_avg and exp_avg_sq per trained parameter, each the parameter's size


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
    identity: dict = field(default_factory=dict)  # the recipe and the data's fingerprint (llmtrain.run.resume)


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
    """The files this rank wrote into a checkpoint: its DCP shards (__<rank>_<i>.distcp), RNG state and its
    registered objects' per-rank state."""
    return sorted([p.name for p in root.glob(f"__{rank}_*.distcp")] + [f"rng_rank{rank}.json"]
                  + [f"{STATE_DIR}/{p.name}" for p in (root / STATE_DIR).glob(f"*_rank{rank}.json")])


class Stateful(Protocol):
    """What a recipe registers with the CheckpointManager: JSON-able state (e.g. a sampling RNG's seed and
    position, a generation buffer's contents)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def _state_file(name: str, per_rank: bool, rank: int) -> str:
    return f"{STATE_DIR}/{name}_rank{rank}.json" if per_rank else f"{STATE_DIR}/{name}.json"


def verify(path: Path) -> list[str]:
    """Collective when a process group exists: what is wrong with checkpoint `path` ([] if nothing); every
    rank gets the same list. Each rank checks every world_size-th file of the manifest (size, then hash), so
    the reading is shared."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problems = _unfinished(path) or _manifest_problems(path, rank, world)
    gathered: list[list[str]] = [problems] * world
    if dist.is_initialized():
        dist.all_gather_object(gathered, problems)
    return sorted({p for ps in gathered for p in ps})


def _unfinished(path: Path) -> list[str]:
    """Why the save of `path` did not finish ([] if it did)."""
    if not (path / ".metadata").is_file():
        return ["no .metadata (DCP's index of the shards): the save did not finish"]
    if not (path / STATE_FILE).is_file():
        return [f"no {STATE_FILE} (the completion marker): the save did not finish"]
    return []


def _manifest_problems(path: Path, rank: int, world: int) -> list[str]:
    """This rank's share (every world-th file) of the manifest's files that are missing, truncated or changed;
    [] without a manifest (an older save)."""
    if not (path / MANIFEST).is_file():
        return []
    try:
        files = sorted(json.loads((path / MANIFEST).read_text())["files"].items())
    except (ValueError, KeyError) as e:
        return [f"{MANIFEST} is unreadable ({e})"]
    return [problem for name, want in files[rank::world] if (problem := _file_problem(path / name, name, want))]


def _file_problem(file: Path, name: str, want: dict) -> str | None:
    """What differs between `file` and its manifest entry `want` (size, then hash), or None."""
    if not file.is_file():
        return f"{name} is missing"
    if file.stat().st_size != want["size"]:
        return f"{name} is {file.stat().st_size} bytes, {want['size']} when saved (truncated?)"
    if file_digest(file)[HASH] != want[HASH]:
        return f"{name} has changed since it was saved ({HASH} differs)"
    return None


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


def checkpoint_bytes(model: nn.Module) -> int:
    """About what one checkpoint weighs on disk, all ranks together: the trained parameters and AdamW's two
    states for each (a DTensor's numel is the whole tensor's, so a sharded model counts once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) * (1 + ADAM_STATES)


def space_warning(output_dir: str, checkpoint_size: int, kept: int, export_size: int, world: int) -> str | None:
    """One line when output_dir's filesystem has less free space than the run will write: `kept` checkpoints
    at a time (0: none planned) and the export, with the numbers; None when it fits."""
    free = free_bytes(output_dir)
    if free >= checkpoint_size * kept + export_size:
        return None
    parts = [f"the export about {megabytes(export_size)}"]
    if kept:
        per_rank = f", {megabytes(checkpoint_size // world)} per rank" if world > 1 else ""
        parts.insert(0, f"{kept} checkpoint{'s' * (kept > 1)} of about {megabytes(checkpoint_size)} each "
                        f"(checkpoint.keep_last and every_steps{per_rank})")
    return (f"output_dir {output_dir} has {megabytes(free)} free, but the run writes {' and '.join(parts)}: it "
            "will fail with 'no space left on device' when it gets there unless space is freed first")


def short_cause(e: BaseException) -> str:
    """The first rank's own error of a DCP CheckpointException (its str is every rank's whole traceback)."""
    failures = getattr(e, "failures", None)
    if failures:
        rank, (exc, _) = sorted(failures.items())[0]
        return f"rank {rank}: {type(exc).__name__}: {exc}"
    return f"{type(e).__name__}: {e}"


class SaveError(RuntimeError):
    """A checkpoint save failed on some rank; every rank raises it (DCP's save and the publish are
    collective), with the same message."""
    collective = True

    def __init__(self, tmp: Path, full: bool, cause: str, size: int):
        name, root = tmp.name.removesuffix(".tmp"), tmp.parent
        done = complete_checkpoints(root)
        intact = (f"earlier checkpoints are intact (newest: {done[-1][1].name}, the one a rerun resumes from)"
                  if done else "there is no earlier checkpoint")
        if full:
            super().__init__(f"no space left on device in {root}: saving checkpoint {name} (about "
                             f"{megabytes(size)}) failed with {megabytes(free_bytes(root))} free; the partial save "
                             f"was removed; {intact}. Free space there (or lower checkpoint.keep_last), then rerun "
                             "the same command")
        else:
            super().__init__(f"saving checkpoint {name} failed ({cause[:300]}); the partial save "
                             f"stays in {tmp} (never loaded); {intact}")


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
        # An async save finishes its collectives in a background thread: on the training group they would
        # interleave with the step's own (gloo: a collective mismatch, seen at torch 2.13). It gets a group of its
        # own (gloo: the state it writes is on the CPU), made by every rank here.
        self.save_group = dist.new_group(backend="gloo") if section.async_ else None
        self.last_save = time.monotonic()
        self.registered: dict[str, tuple[Stateful, bool]] = {}

    def register(self, name: str, obj: Stateful, per_rank: bool = False) -> None:
        """Save obj.state_dict() with every checkpoint (per_rank: each rank's own, restored only at the same
        world size, like the RNG) and give it back through obj.load_state_dict() on resume. Before resume()."""
        if name in self.registered:
            raise ValueError(f"checkpoint state {name!r} registered twice")
        self.registered[name] = (obj, per_rank)

    def _write_registered(self, tmp: Path) -> None:
        for name, (obj, per_rank) in self.registered.items():
            if per_rank or self.rank == 0:
                file = tmp / _state_file(name, per_rank, self.rank)
                file.parent.mkdir(exist_ok=True)
                file.write_text(json.dumps(obj.state_dict()))

    def _read_registered(self, path: Path, same_world: bool) -> None:
        for name, (obj, per_rank) in self.registered.items():
            file = path / _state_file(name, per_rank, self.rank)
            if file.is_file() and (same_world or not per_rank):
                obj.load_state_dict(json.loads(file.read_text()))

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
        self._together(tmp, lambda: self._start(tmp) if self.rank == 0 else None)
        self._together(tmp, lambda: self._write_local(tmp))
        if self.section.async_:
            future = dcp.async_save(self._tensors(), checkpoint_id=str(tmp), process_group=self.save_group)
            hashed = self.hasher.submit(lambda: (future.result(), digests(tmp, own_files(tmp, self.rank)))[1])
            # The loop advances `state` before this save is published: publish the state it saved.
            self.pending = (hashed, tmp, final, copy.deepcopy(state))
        else:
            own = self._together(tmp, lambda: (dcp.save(self._tensors(), checkpoint_id=str(tmp)),
                                               digests(tmp, own_files(tmp, self.rank)))[1])
            self._publish(tmp, final, state, own)
        self.last_save = time.monotonic()
        return final

    @staticmethod
    def _start(tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    def _write_local(self, tmp: Path) -> None:
        (tmp / f"rng_rank{self.rank}.json").write_text(json.dumps(_rng_state()))
        self._write_registered(tmp)

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
        self._publish(tmp, final, state, self._together(tmp, hashed.result))

    def _together(self, tmp: Path, work: Callable[[], object]) -> object:
        """Collective: this rank's part of a save; returns what `work` returns when every rank's part worked.
        Otherwise every rank raises the same SaveError (a full disk may hit one rank, or only rank 0's
        publish: the others must not wait for it in the next collective). A full disk removes the partial
        save: it holds the space the user needs, and is never loaded anyway."""
        try:
            result, failure = work(), None
        except (Exception, dcp.api.CheckpointException) as e:
            result, failure = None, e
        outcomes: list = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, None if failure is None else (no_space(failure), short_cause(failure)))
        failed = [o for o in outcomes if o is not None]
        if not failed:
            return result
        full = any(f[0] for f in failed)
        if full and self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        error = SaveError(tmp, full, next(f[1] for f in failed if f[0] == full), checkpoint_bytes(self.model))
        dist.barrier()  # the partial save is gone before any rank reports it
        raise error from failure

    def _publish(self, tmp: Path, final: Path, state: TrainState, own: dict[str, dict]) -> None:
        """Collective. The manifest gathers every rank's digests of its own files; rank 0 adds the rest."""
        gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(gathered, own)  # also the barrier: every rank's shards are written
        self._together(tmp, lambda: self._publish_main(tmp, final, state, gathered) if self.rank == 0 else None)

    def _publish_main(self, tmp: Path, final: Path, state: TrainState, gathered: list[dict]) -> None:
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
            raise ConfigError(f"checkpoint {path} does not fit this model ({first}); it is left as it is. Resume "
                              "with the settings it was saved with (its config.yaml), or start afresh in another "
                              "output_dir or with checkpoint.resume=never") from None
        set_state_dict(self.model, self.optimizer, model_state_dict=tensors["model"],
                       optim_state_dict=tensors["optim"], options=StateDictOptions(ignore_frozen_params=True,
                                                                                    strict=False))
        state = TrainState(**json.loads((path / STATE_FILE).read_text()))
        same_world = state.world_size == dist.get_world_size()
        rng = path / f"rng_rank{self.rank}.json"
        if same_world and rng.is_file():
            _set_rng_state(json.loads(rng.read_text()))
        self._read_registered(path, same_world)
        return state
