"""Score a model with EleutherAI's lm-evaluation-harness, offline.

    python -m llmtrain.eval --model DIR --tasks demo_facts.yaml,assets/eval/demo/,hellaswag [--limit N]
        [--num-fewshot K] [--batch-size B] [--output results.json] [--device cpu|cuda] [--base BASE_DIR]
    python -m llmtrain.eval --compare base.json tuned.json ...
    torchrun --nproc_per_node=2 -m llmtrain.eval ...     (data-parallel: each rank scores a share of requests)

DIR is a Hugging Face model directory (output_dir/hf), a PEFT adapter directory (on --base, or the base its
adapter_config.json names), or a checkpoint output_dir/checkpoints/step_<N> (converted in memory: no export is
written). --tasks takes lm-eval task names, task YAML files and folders of them; relative data_files in a YAML
are read from the YAML's folder. Nothing is downloaded: a task whose dataset is on the Hub must point at local
files (dataset_path: json + dataset_kwargs.data_files). Needs the extra: pip install 'llmtrain[eval]'."""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

EXTRA = "pip install 'llmtrain[eval]'"
# datasets' packaged builders: they read local files, the Hub is never asked.
LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "pandas", "webdataset", "xml", "sql"}


class EvalError(ValueError):
    """Bad input to the evaluation (the message names the model, task or file); the CLI exits 2 on it."""


def _lm_eval():
    try:
        import lm_eval
    except ImportError:
        raise EvalError(f"lm-evaluation-harness is not installed: {EXTRA}") from None
    return lm_eval


# ----------------------------------------------------------------------------- tasks

def _read_yaml(path: Path) -> dict:
    import yaml
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        config = load_yaml(str(path), resolve_func=True)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise EvalError(f"{where}: malformed task YAML: {getattr(e, 'problem', None) or e}") from None
    except (OSError, ImportError, AttributeError) as e:  # include: / !function targets that do not exist
        raise EvalError(f"{path}: {e}") from None
    if not isinstance(config, dict) or not ("task" in config or "group" in config):
        raise EvalError(f"{path}: not an lm-eval task YAML (no 'task' or 'group' key)")
    return _local_data_files(config, path)


def _local_data_files(task: dict, path: Path) -> dict:
    """Relative data_files -> the YAML's folder (where a bundled task keeps its data) when they exist there,
    else as lm-eval reads them (from the current directory); a file in neither place is an error now."""
    kwargs = task.get("dataset_kwargs") or {}
    files = kwargs.get("data_files")
    if not files or task.get("dataset_path") not in LOCAL_BUILDERS:  # else: relative to the dataset's own root
        return task
    name = task.get("task", path.stem)

    def resolve(f: str) -> str:
        for candidate in (path.parent / f, Path(f)):
            if glob.glob(str(candidate)):  # data_files may be glob patterns
                return str(candidate.absolute())
        raise EvalError(f"task {name} ({path}): data file {f} not found (relative data_files are read from "
                        f"{path.parent} or the current directory)")

    def resolve_all(fs: str | list[str]) -> str | list[str]:
        return [resolve(f) for f in fs] if isinstance(fs, list) else resolve(fs)

    files = {split: resolve_all(fs) for split, fs in files.items()} if isinstance(files, dict) else resolve_all(files)
    return {**task, "dataset_kwargs": {**kwargs, "data_files": files}}


LOCAL_HINT = ("copy the task YAML and point it at local files (dataset_path: json, "
              "dataset_kwargs: {data_files: {test: path/to/test.jsonl}})")


def _check_offline(name: str, task: dict, where: str) -> None:
    path = task.get("dataset_path")
    if path and path not in LOCAL_BUILDERS and not Path(path).exists() and not _in_hf_cache(path):
        raise EvalError(f"task {name} ({where}) needs dataset_path={path} from the Hugging Face Hub, and this run "
                        f"is offline: {LOCAL_HINT}")


def _in_hf_cache(repo: str) -> bool:
    """A Hub dataset downloaded earlier is read from the local cache, offline."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        return any(r.repo_id == repo and r.repo_type == "dataset" for r in scan_cache_dir().repos)
    except CacheNotFound:
        return False


@dataclass
class Tasks:
    """What simple_evaluate runs: built lm-eval Task/Group objects, and the manager that built them."""
    objects: list
    manager: object


def load_tasks(specs: list[str]) -> Tasks:
    """Task names, YAML files and folders of YAML files -> built tasks (their data loaded), or EvalError
    naming the first bad one. Cheap next to scoring: run it before loading the model."""
    _lm_eval()
    from lm_eval.tasks import TaskManager

    configs = []  # (spec as given, config dict or registered name)
    for spec in specs:
        path = Path(spec)
        if path.is_dir():
            found = sorted([*path.glob("*.yaml"), *path.glob("*.yml")])
            if not found:
                raise EvalError(f"task folder {spec} has no .yaml task files")
            configs += [(str(f), _read_yaml(f)) for f in found]
        elif path.suffix in (".yaml", ".yml") or os.sep in spec:
            if not path.is_file():
                raise EvalError(f"task file {spec} not found")
            configs.append((spec, _read_yaml(path)))
        else:
            configs.append((spec, spec))
    # Indexing lm-eval's own ~15k tasks takes ~20 s: only when a name asks for one of them.
    manager = TaskManager(include_defaults=any(isinstance(c, str) for _, c in configs))
    objects = []
    for spec, config in configs:
        if isinstance(config, str):
            entry = manager.task_index.get(config)
            if entry is None:
                raise EvalError(f"unknown task {config}: not an lm-eval task, group or tag, nor a task .yaml "
                                "file or folder (`lm-eval ls tasks` lists the tasks)")
            if entry.cfg:
                _check_offline(config, entry.cfg, str(entry.yaml_path or "lm-eval"))
        else:
            _check_offline(config["task"] if "task" in config else spec, config, spec)
        try:
            built = manager.load([config])
        except EvalError:
            raise
        except Exception as e:  # noqa: BLE001 - the harness raises anything; the user needs one line
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            # A group's or tag's subtasks are checked only here, when datasets fails to reach the Hub.
            hub = any(w in f"{type(e).__name__} {first}".lower() for w in ("offline", "hub", "connection"))
            raise EvalError(f"task {spec}: {type(e).__name__}: {first}" + (f"; {LOCAL_HINT}" if hub else "")) \
                from None
        # load() flattens: hand simple_evaluate the top-level groups and tasks, not their members again.
        members = {child for children in built.get("group_map", {}).values() for child in children}
        objects += [obj for name, obj in [*built.get("groups", {}).items(), *built["tasks"].items()]
                    if name not in members]
    return Tasks(objects, manager)


# ----------------------------------------------------------------------------- models

@dataclass
class Loaded:
    model: object
    tokenizer: object


def load_model(path: Path, base: Path | None, dtype: str, device: str) -> Loaded:
    """An HF directory, a PEFT adapter directory (on its base) or a DCP checkpoint -> a model in eval mode."""
    if not path.is_dir():
        raise EvalError(f"--model {path}: no such directory")
    if (path / "adapter_config.json").is_file():
        loaded = _load_adapter(path, base, dtype)
    elif (path / "config.json").is_file():
        loaded = Loaded(_from_pretrained(path, dtype), _tokenizer(path))
    elif (path / ".metadata").is_file():
        loaded = _load_checkpoint(path, dtype)
    else:
        raise EvalError(f"--model {path}: not a model directory (no config.json), a PEFT adapter (no "
                        "adapter_config.json) or a checkpoints/step_<N> directory (no .metadata)")
    loaded.model.to(device).eval()
    return loaded


def _torch_dtype(dtype: str):
    from llmtrain.utils import DTYPES

    return "auto" if dtype == "auto" else DTYPES[dtype]


def _from_pretrained(path: Path, dtype: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=_torch_dtype(dtype))


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _load_adapter(path: Path, base: Path | None, dtype: str) -> Loaded:
    from peft import PeftModel

    named = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    base = base or (Path(named) if named else None)
    if base is None or not (base / "config.json").is_file():
        raise EvalError(f"--model {path} is a PEFT adapter whose base "
                        f"{base or '(not named in adapter_config.json)'} is not a model directory here; pass --base")
    model = PeftModel.from_pretrained(_from_pretrained(base, dtype), path).merge_and_unload()
    return Loaded(model, _tokenizer(path if (path / "tokenizer_config.json").is_file() else base))


def _load_checkpoint(path: Path, dtype: str) -> Loaded:
    """As llmtrain.convert would export it, but in memory (model_from_weights)."""
    from llmtrain import convert
    from llmtrain.utils import DTYPES

    dtype = "fp32" if dtype == "auto" else dtype  # the recipe's export_dtype default
    try:
        ckpt = convert.read_checkpoint(path, dtype)
        weights = convert.merged_lora(convert.lora_config(path), ckpt.weights, ckpt.config) if ckpt.lora \
            else ckpt.weights
    except convert.CheckpointError as e:
        raise EvalError(str(e)) from None
    config = ckpt.config
    config.use_cache = True  # as the export writes it
    model = model_from_weights(config, {k: v.to(DTYPES[dtype]) for k, v in weights.items()}, DTYPES[dtype],
                               f"--model {path}")
    return Loaded(model, ckpt.tokenizer)


def model_from_weights(config, weights: dict, dtype, what: str):
    """A model of `config` holding `weights` (a full state dict, tied output layer optional): assigned to a model
    built on meta, so one copy, the non-persistent buffers (RoPE) computed as from_pretrained computes them.
    EvalError naming `what` when a weight is missing or unknown."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    result = model.load_state_dict({k: v for k, v in weights.items() if k not in tied}, strict=False, assign=True)
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise EvalError(f"{what}: the weights do not match the model config (missing {sorted(missing)[:3]}, "
                        f"unexpected {result.unexpected_keys[:3]})")
    model.tie_weights()
    return model


# ----------------------------------------------------------------------------- scoring

def evaluate(model, tokenizer, tasks: Tasks, limit: float | None = None, num_fewshot: int | None = None,
             batch_size: int = 1, data_parallel: bool = False) -> dict | None:
    """lm-eval's simple_evaluate on an in-memory model, with the harness's defaults (seeds, no chat
    template): the harness's results dict on rank 0, None on the other ranks.

    data_parallel: the default process group's ranks each score a share of the requests. HFLM does this
    only for a model it loads itself on >1 CUDA devices (never on CPU, never for a model object), so we
    give it the rank, world size and an accelerate Accelerator (its collectives) as its own DP setup would."""
    _lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    if data_parallel:
        from accelerate import Accelerator

        # cpu=True: otherwise accelerate on a CPU machine sees no distributed run (one process of one).
        lm.accelerator = Accelerator(cpu=lm.device.type == "cpu")
        if lm.accelerator.num_processes < 2:
            raise EvalError("data_parallel: accelerate found no multi-process launch (torchrun / accelerate launch)")
        lm._rank, lm._world_size = lm.accelerator.process_index, lm.accelerator.num_processes
    return simple_evaluate(model=lm, tasks=tasks.objects, task_manager=tasks.manager, limit=limit,
                           num_fewshot=num_fewshot, batch_size=batch_size, log_samples=False)


@contextmanager
def _rng_kept():
    import random

    import numpy as np
    import torch

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def flat_scores(results: dict) -> dict[str, float]:
    """The harness's results -> {"harness/<task>/<metric>": value} (metric,filter as lm-eval keys it, e.g.
    "acc,none"; standard errors left out), the keys the recipes log."""
    return {f"harness/{task}/{metric}": float(value) for task, metrics in results["results"].items()
            for metric, value in metrics.items()
            if "," in metric and "_stderr," not in metric and isinstance(value, (int, float))}


def score(model, tokenizer, tasks: list[str], limit: float | None = None, num_fewshot: int | None = None,
          batch_size: int = 1, data_parallel: bool = False) -> dict[str, float]:
    """For the recipes: an in-memory model (or a model directory: str/Path, as --model takes) scored on
    `tasks` -> {"harness/<task>/<metric>": value} on rank 0 ({} on the other ranks). EvalError on bad input."""
    # Building tasks draws from `random`, simple_evaluate seeds random, numpy and torch, and HFLM puts the
    # model in eval mode: a training run's RNG streams and mode come back as they were.
    with _rng_kept():
        loaded_tasks = load_tasks(tasks)
        if isinstance(model, (str, Path)):
            loaded = load_model(Path(model), None, "auto", "cuda" if _cuda() else "cpu")
            model, tokenizer = loaded.model, loaded.tokenizer
        training = model.training
        try:
            results = evaluate(model, tokenizer, loaded_tasks, limit, num_fewshot, batch_size, data_parallel)
        finally:
            model.train(training)
    return flat_scores(results) if results else {}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ----------------------------------------------------------------------------- output

def write_results(results: dict, out: Path) -> None:
    """The JSON lm-eval's CLI writes (its results dict), published by rename: never half a file."""
    from lm_eval.utils import handle_non_serializable

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    os.replace(tmp, out)


def table(results: dict) -> str:
    from lm_eval.utils import make_table

    text = make_table(results)
    return text + ("\n" + make_table(results, "groups") if results.get("groups") else "")


def compare(paths: list[Path]) -> str:
    """Result files side by side: one row per task/metric/filter, one column per file, value ± stderr."""
    runs = []
    for p in paths:
        try:
            runs.append(json.loads(p.read_text())["results"])
        except (OSError, ValueError, KeyError) as e:
            raise EvalError(f"--compare {p}: not an lm-eval results file ({type(e).__name__}: {e})") from None
    names = [p.stem if len({q.stem for q in paths}) == len(paths) else str(p) for p in paths]
    rows = []
    for task in dict.fromkeys(t for run in runs for t in run):
        for key in dict.fromkeys(k for run in runs for k in run.get(task, {})):
            if "," not in key or "_stderr," in key:  # "metric,filter" keys only (not alias, sample_len)
                continue
            metric, _, filt = key.partition(",")
            cells = []
            for run in runs:
                value = run.get(task, {}).get(key)
                err = run.get(task, {}).get(f"{metric}_stderr,{filt}")
                cells.append("-" if not isinstance(value, (int, float)) else
                             f"{value:.4f}" + (f" ± {err:.4f}" if isinstance(err, (int, float))
                                               and not math.isnan(err) else ""))
            rows.append([task, metric, filt, *cells])
    header = ["task", "metric", "filter", *names]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(r) -> str:
        return " | ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([line(header), "-+-".join("-" * w for w in widths), *map(line, rows)])


# ----------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmtrain.eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", type=Path, help="HF model dir, PEFT adapter dir or checkpoints/step_<N>")
    p.add_argument("--base", type=Path, help="base model dir of a PEFT adapter (default: its adapter_config)")
    p.add_argument("--tasks", help="comma-separated lm-eval task names, task .yaml files and folders")
    p.add_argument("--limit", type=float, help="score only the first N documents of each task (<1: a fraction)")
    p.add_argument("--num-fewshot", type=int)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--output", type=Path, help="write the harness's results JSON here")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="auto: the model directory's own dtype (fp32 for a checkpoint)")
    p.add_argument("--compare", type=Path, nargs="+", metavar="RESULTS_JSON",
                   help="print these results files side by side instead of scoring")
    args = p.parse_args(argv)
    try:
        if args.compare:
            print(compare(args.compare))
            return 0
        if not args.model or not args.tasks:
            p.error("--model and --tasks are required (or --compare)")
        return _run(args)
    except EvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    # Offline by design: set before datasets / huggingface_hub read them at import.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if args.limit is not None and args.limit >= 1:
        args.limit = int(args.limit)
    if not (args.model.is_dir()):  # before the ~5 s of importing the harness
        raise EvalError(f"--model {args.model}: no such directory")
    tasks = load_tasks([t for t in args.tasks.split(",") if t])
    data_parallel = int(os.environ.get("WORLD_SIZE", "1")) > 1
    device = args.device or ("cuda" if _cuda() else "cpu")
    if data_parallel and device == "cuda":
        device = f"cuda:{os.environ['LOCAL_RANK']}"
    loaded = load_model(args.model, args.base, args.dtype, device)
    results = evaluate(loaded.model, loaded.tokenizer, tasks, args.limit, args.num_fewshot, args.batch_size,
                       data_parallel)
    if results is None:  # not rank 0
        return 0
    if args.output:
        write_results(results, args.output)
    print(table(results))
    if args.output:
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
