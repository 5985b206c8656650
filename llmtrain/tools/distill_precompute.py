"""Precompute an offline distillation teacher: the teacher's (distill.teacher_path) top-k log-probs of every
token recipes/distill.py will train on, in its global sample order, for distill.teacher_logits.

    python -m llmtrain.tools.distill_precompute --config configs/demo-distill.yaml --out DIR [key.sub=value ...]
    torchrun --standalone --nproc_per_node=N -m llmtrain.tools.distill_precompute --config ... --out DIR

Takes the recipe's config (the same file and overrides the training run will use): its data, seed, tokenizer,
distill.top_k (> 0) and distill.temperature decide the values; parallel.* shards the teacher (each rank
computes and writes its share of every global batch). --samples: how many samples of the global order to
cover (default train.max_steps x the global batch at this run's world size; a training run on more ranks
needs more). DIR must not exist; it appears complete or not at all, on a file system every rank sees.
What is stored: llmtrain/recipes/distill/teacher.py; docs/distill.md, "Offline teacher"."""

from __future__ import annotations

import argparse
import dataclasses
import math
import signal
import time
from pathlib import Path

import torch

from llmtrain import data, distributed
from llmtrain.config import ConfigError, load_config
from llmtrain.losses.token import next_token_targets
from llmtrain.models import hf, lora
from llmtrain.recipes.distill import teacher as stored
from llmtrain.recipes.distill.config import DistillConfig, check_kd_settings, check_teacher, teacher_dtype
from llmtrain.run import failures
from llmtrain.train import frozen
from llmtrain.train.cli import exit_code, fail


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m llmtrain.tools.distill_precompute",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--config", help="the distillation run's YAML config (configs/demo-distill.yaml)")
    p.add_argument("--out", required=True, help="the directory to write (must not exist)")
    p.add_argument("--samples", type=int, help="samples of the global order to cover (default: train.max_steps x "
                                               "the global batch at this world size)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    return p.parse_intermixed_args(argv)


def setup(args: argparse.Namespace) -> DistillConfig:
    """Bad input, before any process group: the teacher, top_k, the data, the output directory."""
    cfg = load_config(args.config, args.overrides, DistillConfig)
    check_kd_settings(cfg, "precomputed")
    check_teacher(cfg, precompute=True)
    hf.check_paths(cfg.model, cfg.tokenizer.path)
    data.check(cfg.data)
    out = Path(args.out)
    if out.exists():
        raise ConfigError(f"--out: {out} exists; remove it or choose another directory")
    if args.samples is not None and args.samples < 1:
        raise ConfigError(f"--samples: {args.samples}; give at least 1")
    return cfg


def precompute(cfg: DistillConfig, env: distributed.DistEnv, out: Path, samples: int | None) -> dict:
    """Every rank: its share of each global batch through the teacher, into its shard; rank 0: the manifest
    and the rename. Returns the manifest."""
    t0, t, d = time.perf_counter(), cfg.train, cfg.distill
    tokenizer = hf.load_tokenizer(cfg.tokenizer.path or cfg.model.path, cfg.model.trust_remote_code)
    built = data.build(cfg.data, tokenizer, t.seed, env.is_main, env.rank, env.world_size)
    steps = data.make_steps(built, t.micro_batch_size, t.grad_accum_steps, env.world_size, env.rank, t.seed,
                            env.device, {})
    samples = samples or t.max_steps * steps.global_batch
    parallel = dataclasses.replace(cfg.parallel, mixed_precision=teacher_dtype(cfg))  # no student: its own dtype
    model = frozen.standalone(*stored.teacher_source(d.teacher_path, cfg.model), parallel, env, t.seed, "chunked",
                              t.loss_chunk_tokens, "teacher")
    teacher = stored.LiveTeacher(model, len(tokenizer), d.temperature, d.top_k)
    if env.is_main:
        stored.fresh_partial(out)
    distributed.gather_objects(None)  # the partial directory exists before any rank writes into it
    shard = stored.Shard()
    chunk = model.token_loss.chunk_tokens
    for step in range(math.ceil(samples / steps.global_batch)):
        for batch in next(steps):
            positions = step * steps.global_batch + batch[data.SAMPLE_INDEX]
            batch = {k: v.to(env.device) for k, v in batch.items()}
            counts = (next_token_targets(batch["labels"]) != data.IGNORE).sum(1)

            def keep(dist, positions=positions, counts=counts):
                parts = [dist(slice(a, a + chunk)) for a in range(0, int(counts.sum()), chunk)]
                shard.add(positions, counts, torch.cat([p.logps for p in parts]), torch.cat([p.ids for p in parts]))

            teacher.dists(batch, keep)
    entries = distributed.gather_objects(shard.write(stored.partial_dir(out) / f"rank{env.rank:05d}.safetensors",
                                                     d.top_k))
    want = stored.expected(cfg.data, t.seed, tokenizer, d.top_k, d.temperature)
    manifest = {"version": stored.VERSION, **want._asdict(), "samples": samples,
                "teacher": {"path": d.teacher_path, "dtype": teacher_dtype(cfg),
                            "weights": lora.fingerprint(d.teacher_path, None, t.seed)["fingerprint"]},
                "shards": entries}
    if env.is_main:
        stored.write_manifest(out, manifest)
        tokens = sum(e["tokens"] for e in entries)
        print(f"distill_precompute: {samples} samples ({tokens} trained tokens, top {d.top_k} at temperature "
              f"{d.temperature:g}) in {time.perf_counter() - t0:.1f} s -> {out}", flush=True)
    distributed.gather_objects(None)  # every rank returns once the directory is published
    return manifest


# Not the recipes' path (distributed.PreemptionFlag: finish the step, save, exit 42; a lost peer is then named by the
# next collective's error in train/cli.report): a precompute has nothing to save, and its ddp teacher runs no
# collective per batch that would fail, so a signal stops it here, at once, with one line.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
    """A stop signal (torchrun's SIGTERM to the others when a rank dies, a scheduler's, Ctrl-C)."""


def _stop(signum, _frame) -> None:
    for sig in STOP_SIGNALS:  # once: a second signal must not interrupt the line and the shutdown
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signal.Signals(signum).name)


def stopped_line(e: BaseException, rank: int, out: Path) -> str | None:
    """The one line of a precompute stopped by a signal or by a lost peer (None for any other error): who ended
    and that nothing was written (the directory appears complete or not at all)."""
    if isinstance(e, Stopped):
        dead = failures.dead_peers()
        why = f"stopped by {e}" + (f" ({'; '.join(f'rank {r} {how}' for r, how in dead.items())})" if dead else "")
        line = f"error (rank {rank}): distill_precompute {why}"
    elif lost := failures.lost_peer(e, rank):
        line = f"error: {lost}"
    else:
        return None
    return f"{line}; {out} was not written (it appears only when complete): run the command again"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = setup(args)
    except ConfigError as e:
        return fail(f"error: {e}", 2, once=True)
    env = distributed.init(cfg.distributed)
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop)
    try:
        precompute(cfg, env, Path(args.out), args.samples)
        return exit_code(0)
    except ConfigError as e:
        return fail(f"error: {e}", 2, once=True)
    except (Stopped, RuntimeError) as e:
        if line := stopped_line(e, env.rank, Path(args.out)):
            return fail(line, 1)
        raise
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    distributed.hard_exit(main())
