"""The command line every recipe shares: arguments, set-up checks, process group, the error -> exit code
mapping (bad input 2, failure 1, preempted 42), lock release and shutdown (Recipe.main calls main)."""

from __future__ import annotations

import argparse
import glob
import os
import time
import traceback
from pathlib import Path
from typing import Callable

from llmtrain import checkpoint, data, distributed, export, launch, parallelize
from llmtrain.run import failures, lock
from llmtrain import metrics as metrics_lib
from llmtrain.config import Config, ConfigError, RunError, describe, input_paths, load_config, to_yaml
from llmtrain.losses import token as loss_lib
from llmtrain.models import hf as model_lib
from llmtrain.models import lora, nf4, ulysses
from llmtrain.data import vision as vision_data
from llmtrain.train import harness
from llmtrain.train.loop import Preempted
from llmtrain.utils import nesting, print_piped


def parse_args(argv: list[str] | None, usage: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=usage, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Overrides: dotted keys, e.g. train.lr=1e-4 parallel.strategy=fsdp2 "
                                       "(see --help-config).")
    p.add_argument("--config", help="YAML config file (configs/*.yaml)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--help-config", action="store_true", help="list every config key and exit")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    return p.parse_args(argv)


def setup(args: argparse.Namespace, config_cls: type[Config] = Config,
          check: Callable[[Config], None] | None = None) -> Config:
    """Everything that can be checked without a process group or a model: bad input fails here. The
    recipe's own `check` goes first: it can explain what the recipe expects (e.g. where its model comes from)."""
    cfg = load_config(args.config, args.overrides, config_cls)
    check_apart(cfg.output_dir, input_paths(cfg))
    if check:
        check(cfg)
    # Under `accelerate launch`: every setting it asks for must be what parallel.* gives (parallel.* governs).
    for line in launch.check_accelerate(cfg.parallel, os.environ):
        if os.environ.get("RANK", "0") == "0" and not args.print_config:
            print(line, flush=True)
    model_lib.check_paths(cfg.model, cfg.tokenizer.path)
    data.check(cfg.data)
    vision_data.check(cfg.data, cfg.model, cfg.parallel.sp_size)
    device, _ = distributed.pick_device(cfg.distributed, distributed.local_rank_from_env())
    parallelize.check(cfg.parallel, distributed.world_size_from_env(), device.type)
    if cfg.parallel.sp_size > 1:
        ulysses.check(cfg.parallel.sp_size, distributed.world_size_from_env(), cfg.data.seq_len,
                      *model_lib.attention_shape(cfg.model))
    checkpoint.check_writable(cfg.output_dir)
    checkpoint.check_resume(cfg.checkpoint)  # which checkpoint, verified, is build()'s choice (collective)
    lora.check(cfg.lora)
    nf4.check(cfg.lora, cfg.parallel.strategy)
    harness.check(cfg.eval.harness)
    metrics_lib.check(cfg.log)
    loss_lib.check(cfg.train.loss_impl, device.type)
    return cfg


def check_apart(output_dir: str, inputs: dict[str, str]) -> None:
    """No run writes where one of its inputs lies (config.input_paths: what every section declares it reads): an
    output_dir that is, lies inside or holds one is refused, naming both, before anything is written. A path that
    is not on this disk (a Hub id) holds nothing to lose; a glob is the files it matches."""
    out = Path(output_dir).resolve()
    for key, path in inputs.items():
        for found in sorted(glob.glob(path, recursive=True)) if glob.has_magic(path) else [path]:
            place = Path(found).resolve()
            if not place.exists():
                continue
            if how := nesting(out, place):
                raise ConfigError(f"output_dir={output_dir} {how} {key}={found}: a run writes its config.yaml, "
                                  "metrics, checkpoints and export (hf/, replaced) there; give the run an "
                                  "output_dir apart from its inputs")


def main(argv: list[str] | None, usage: str, config_cls: type[Config],
         train: Callable[[Config, distributed.DistEnv], object],
         check: Callable[[Config], None] | None = None) -> int:
    """Parse, check (the recipe's own `check`, then the shared ones), init, train; returns the exit code."""
    args = parse_args(argv, usage)
    if args.help_config:
        print_piped("".join(f"{key:36} {tp:48} {default:14} {doc}\n" for key, tp, default, doc in describe(config_cls)))
        return 0
    try:
        cfg = setup(args, config_cls, check)
    except ConfigError as e:  # every rank finds it alike: printed once (failures.error_once)
        return fail(f"error: {e}", 2, once=True)
    if args.print_config:
        print_piped(to_yaml(cfg))
        return 0
    try:
        env = distributed.init(cfg.distributed, cfg.parallel.sp_size)
    except distributed.PreflightError as e:  # a rank missing or unreachable, named, within the preflight timeout
        return fail(f"error: preflight failed: {e}", 1)
    try:
        train(cfg, env)
        return exit_code(0)
    except Preempted:
        return exit_code(distributed.PREEMPTED_EXIT_CODE)
    except ConfigError as e:
        return fail(f"error: {e}", 2, once=True)
    except Exception as e:
        line = report(e, cfg.output_dir, env.rank)
        failures.tell_launcher(line)
        return exit_code(1)
    finally:
        lock.release()
        distributed.shutdown()


def fail(line: str, code: int, once: bool = False) -> int:
    """Print the error line (`once`: once for all ranks that print the same), hand it to torchrun for its
    failure report, and return the exit code."""
    (failures.error_once if once else failures.write_line)(line)
    failures.tell_launcher(line)
    return exit_code(code)


def exit_code(code: int) -> int:
    """This rank's exit code, also appended to the file LLMTRAIN_EXIT_FILE names when it exists (the wrapper
    made it on its node; ranks on other nodes find none): torchrun exits 1 whatever its workers exit with, so a
    wrapper (slurm/common.sh) reads the ranks' codes there."""
    if path := os.environ.get("LLMTRAIN_EXIT_FILE"):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            os.write(fd, f"{code}\n".encode())
            os.close(fd)
        except OSError:
            pass  # not on this node
    return code


def report(e: Exception, output_dir: str, rank: int) -> str:
    """One line on the console, also returned (an error every rank raises alike, e.g. a checkpoint save's: rank 0's line
    only); the traceback goes to output_dir/errors-rank<R>.log (the console when that cannot be written, e.g.
    on a full disk)."""
    expected = isinstance(e, (FloatingPointError, RunError, checkpoint.SaveError, export.ExportError,
                              distributed.PreflightError))
    log = Path(output_dir) / f"errors-rank{rank}.log"
    try:
        with open(log, "a") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}\n{traceback.format_exc()}")
        where = f"traceback in {log}"
    except OSError:
        traceback.print_exc()
        where = "traceback above"
    if lost := failures.lost_peer(e, rank):  # not gloo's or NCCL's raw text: who, where, what is saved
        saved = checkpoint.complete_checkpoints(Path(output_dir) / "checkpoints")
        newest = f"{saved[-1][1]} (a rerun resumes from it)" if saved else "none yet (a rerun starts afresh)"
        line = f"error: {lost}; newest checkpoint: {newest} ({where})"
    else:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        summary = str(e) if expected else f"training failed: {type(e).__name__}: {first[:500]}"
        prefix = "error:" if getattr(e, "collective", False) else f"error (rank {rank}):"
        line = f"{prefix} {summary} ({where})"
    if not getattr(e, "collective", False) or rank == 0:
        failures.write_line(line)
    return line
