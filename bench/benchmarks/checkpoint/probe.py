"""Checkpoint speed through llmtrain.checkpoint, under torchrun (bench/run.py, "checkpoint").

    torchrun --standalone --nproc_per_node=2 bench/benchmarks/checkpoint/probe.py --dir DIR --shape JSON --out R.json

An FSDP2 model from an inline Llama config (random init), AdamW after one step (so the optimizer
state exists), then, all timed between barriers on rank 0:
  save    CheckpointManager.save (DCP, every rank writes and hashes its shards, fsync, publish by rename)
  load    checkpoint.choose_resume (resume=auto: verify sizes and hashes) + CheckpointManager.resume into
          the same model and optimizer (DCP read + set_state_dict; the files were just written, so they
          are in the page cache)
  export  checkpoint.export_hf (gather to rank 0, safetensors fp32 + config + tokenizer)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/: common, benchmarks

import torch
import torch.distributed as dist

from common import tokenizer_and_config



def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--shape", required=True, help="inline Llama config (JSON)")
    p.add_argument("--strategy", default="fsdp2")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    from llmtrain import checkpoint, distributed, export, optim
    from llmtrain.config import CheckpointConfig, DistributedConfig, ModelConfig, ParallelConfig, TrainConfig
    from llmtrain.losses.token import token_loss_sum
    from llmtrain.models.build import build_model

    env = distributed.init(DistributedConfig(preflight=False))
    section = ModelConfig(config=json.loads(args.shape))
    tokenizer, model_config = tokenizer_and_config(section)
    built = build_model(section, model_config, ParallelConfig(strategy=args.strategy), env, seed=0)
    model, plan, n_params = built.model, built.plan, built.n_params
    tcfg = TrainConfig()
    opt = optim.build_optimizer(model, tcfg, tcfg.lr, built.no_decay)
    ids = torch.randint(0, len(tokenizer), (1, 64), generator=torch.Generator().manual_seed(env.rank))
    token_loss_sum(model(input_ids=ids, use_cache=False).logits, ids).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    out_dir = args.dir / "run"
    manager = checkpoint.CheckpointManager(CheckpointConfig(every_steps=1, keep_last=1), str(out_dir), model, opt,
                                           env.rank, "bench: {}\n", model_config, tokenizer)
    state = checkpoint.TrainState(step=1, samples_seen=1, global_batch=env.world_size, world_size=env.world_size)
    save_s = timed(lambda: manager.save(state))
    ckpt = out_dir / "checkpoints" / "step_1"
    shards = sum(f.stat().st_size for f in ckpt.iterdir() if f.is_file() and f.suffix == ".distcp")
    total = du(ckpt)
    resumed = []  # checkpoint.resume=auto (the default) loads the step just saved
    load_s = timed(lambda: resumed.append(manager.resume(checkpoint.choose_resume(manager.section, out_dir))))
    assert resumed[0] is not None and resumed[0].step == 1, resumed
    hf = args.dir / "hf"
    export_s = timed(lambda: export.export_hf(model, plan.strategy, env.device, hf, model_config, tokenizer))
    if env.is_main:
        result = {"n_params": n_params, "strategy": plan.strategy.name, "world_size": env.world_size,
                  "save_s": save_s, "load_s": load_s, "export_s": export_s, "checkpoint_bytes": total,
                  "shard_bytes": shards, "export_bytes": du(hf)}
        args.out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result))
    distributed.shutdown()


if __name__ == "__main__":
    from llmtrain.distributed import hard_exit

    main()
    hard_exit(0)
