"""Diagnostic for the overhead benchmark: where does the recipe's step time go? Not part of run.py.

    torchrun --standalone --nproc_per_node=2 bench/benchmarks/overhead/step_interleave.py \\
        [--config configs/demo.yaml] [--rounds 20]

One process group, one model (built by llmtrain as the recipe builds it), and four kinds of step
alternated step by step, so that load from other processes hits all of them alike (separate
launches on a shared machine differ by more than the effect measured):

  recipe     the recipe's loop body: next batch from llmtrain.data (packed rows with position_ids),
             llmtrain.train.step.accumulate (token-weighted chunked loss, all-reduces, clipping, AdamW), the
             per-step preemption all-reduce
  recipe, arange positions   the same with position_ids 0..seq_len-1 (no block-causal mask)
  recipe, train.loss_impl=full   the same with the full-logits loss
  bare       model(input_ids, labels).loss.backward(); opt.step(); zero_grad() on a random batch
  bare + packed positions    the bare step on a packed batch with its position_ids

Each step is timed on rank 0 between barriers; medians of --rounds rounds are printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()

    from llmtrain import data, distributed, optim
    from llmtrain.config import load_config
    from llmtrain.losses.token import TokenLoss
    from llmtrain.models import hf as model_lib
    from llmtrain.models.build import build_model
    from llmtrain.recipes.sft import TokenObjective
    from llmtrain.train.step import Stepper, accumulate

    cfg = load_config(args.config, ["distributed.preflight=false"])
    env = distributed.init(cfg.distributed)
    tok = model_lib.load_tokenizer(cfg.tokenizer.path, False)
    mc = model_lib.load_model_config(cfg.model, tok)
    policy = build_model(cfg.model, mc, cfg.parallel, env, cfg.train.seed)
    model = policy.model
    model.train()
    opt = optim.build_optimizer(model, cfg.train, cfg.train.lr, policy.no_decay)
    stepper = Stepper(model, policy.plan, opt, None, cfg.train.max_grad_norm, env.device, env.world_size)
    objectives = {impl: TokenObjective(TokenLoss(impl, model, env.device)) for impl in ("chunked", "full")}
    built = data.build(cfg.data, tok, cfg.train.seed, env.is_main, env.rank, env.world_size)
    micro, seq = cfg.train.micro_batch_size, cfg.data.seq_len
    steps = data.make_steps(built, micro, cfg.train.grad_accum_steps, env.world_size, env.rank, cfg.train.seed,
                            env.device, {})
    packed = next(steps)[0]
    rand = torch.randint(0, len(tok), (micro, seq), generator=torch.Generator().manual_seed(env.rank))
    arange = torch.arange(seq).expand(micro, -1)

    def recipe_step(positions=None, impl="chunked"):
        batches = next(steps)
        if positions is not None:
            batches = [{**b, "position_ids": positions} for b in batches]
        accumulate(stepper, batches, objectives[impl], (cfg.train.seed, 0))
        distributed.any_rank(False, False, device=env.device)

    def bare_step(ids, positions=None):
        model(input_ids=ids, position_ids=positions, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    kinds = {"recipe": recipe_step, "recipe, arange positions": lambda: recipe_step(arange),
             "recipe, train.loss_impl=full": lambda: recipe_step(impl="full"),
             "bare": lambda: bare_step(rand), "bare + packed positions":
             lambda: bare_step(packed["input_ids"], packed["position_ids"])}
    times = {k: [] for k in kinds}
    for fn in kinds.values():  # warm-up
        fn()
        fn()
    for _ in range(args.rounds):
        for name, fn in kinds.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    if env.is_main:
        base = statistics.median(times["bare"])
        print(f"{cfg.parallel.strategy}, {env.world_size} ranks, micro-batch {micro} x {seq}, {args.rounds} rounds")
        print("| step | median ms | min ms | bare / this (median) |\n| --- | ---: | ---: | ---: |")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"| {name} | {med * 1e3:.0f} | {min(ts) * 1e3:.0f} | {base / med:.3f} |")
    distributed.shutdown()


if __name__ == "__main__":
    from llmtrain.distributed import hard_exit

    main()
    hard_exit(0)
