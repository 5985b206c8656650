"""Memory per rank of llmtrain's loading and training state, under torchrun (bench/run.py, "memory").

    python bench/benchmarks/memory/probe.py --export DIR --shape JSON             # one process: a random model
    torchrun --standalone --nproc_per_node=2 bench/benchmarks/memory/probe.py --model DIR --strategy fsdp2 --out R.json

The second form goes through the recipe's own pieces (llmtrain.models.build / optim / loss):
models.build.build_model from DIR (fsdp2/ddp: each rank reads the slices its
parameters cover; fsdp: one unit at a time is gathered and filled with whole tensors) -> AdamW -> one
training step. Per rank it reports:

  load_peak_bytes    VmHWM during build_model (parallelize + load) minus the RSS just before (VmHWM is
                     reset there through /proc/self/clear_refs), and the same for RssAnon sampled
                     every 2 ms (file pages mapped by safetensors count in VmHWM, not in RssAnon)
  params/grads/optim_bytes  the sum of this rank's local tensor bytes: DTensor local shards (FSDP2),
                     FSDP1 flat parameters and their gradients, whole tensors (DDP); optimizer state
                     after one step (exp_avg, exp_avg_sq, step)
  peak_rss_bytes     the process's peak RSS (getrusage ru_maxrss) at the end: imports, the loading
                     peak, activations and temporaries included
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/: common, benchmarks

import torch

from common import proc_status, reset_peak_rss, tokenizer_and_config


def export(out: Path, shape: dict, seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**shape))
    model.save_pretrained(out, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"params": n, "bytes": sum(f.stat().st_size for f in out.glob("*.safetensors"))}))


class AnonPeak:
    """RssAnon sampled in a thread: the peak of anonymous (non-file) resident memory."""

    def __init__(self, period: float = 0.002):
        self.period, self.peak, self.stop = period, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, proc_status().get("RssAnon", 0))
            time.sleep(self.period)

    def __enter__(self):
        self.peak = proc_status().get("RssAnon", 0)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, proc_status().get("RssAnon", 0))


def local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def training_state_bytes(model, strategy: str, opt=None) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes held by this rank."""
    if strategy == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        flats = [m._handle.flat_param for m in FSDP.fsdp_modules(model) if m._handle is not None]
        params = sum(local_bytes(f) for f in flats)
        grads = sum(local_bytes(f.grad) for f in flats)
        if grads == 0:  # use_orig_params: the sharded gradient lives in views on the original parameters
            grads = sum(local_bytes(p.grad) for p in model.parameters())
    else:
        params = sum(local_bytes(p) for p in model.parameters())
        grads = sum(local_bytes(p.grad) for p in model.parameters())
    optim = 0
    if opt is not None:
        for state in opt.state.values():
            optim += sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return params, grads, optim


def probe(args) -> None:
    import torch.distributed as dist

    from llmtrain import distributed, optim
    from llmtrain.config import DistributedConfig, ModelConfig, ParallelConfig, TrainConfig
    from llmtrain.losses.token import token_loss_sum
    from llmtrain.models.build import build_model

    env = distributed.init(DistributedConfig(preflight=False))
    section = ModelConfig(path=str(args.model))
    tokenizer, model_config = tokenizer_and_config(section)
    dist.barrier()

    # Loading: everything from the empty (meta) model to weights in place.
    before = proc_status()
    hwm_reset = reset_peak_rss()
    with AnonPeak() as anon:
        built = build_model(section, model_config, ParallelConfig(strategy=args.strategy), env, seed=0)
    model, plan, n_params, no_decay = built.model, built.plan, built.n_params, built.no_decay
    after = proc_status()
    dist.barrier()
    params_loaded, _, _ = training_state_bytes(model, args.strategy)

    # One step: gradients, then optimizer state.
    model.train()
    tcfg = TrainConfig()
    opt = optim.build_optimizer(model, tcfg, tcfg.lr, no_decay)
    gen = torch.Generator().manual_seed(env.rank)
    ids = torch.randint(0, len(tokenizer), (args.micro_batch, args.seq_len),
                        generator=gen)
    pos = torch.arange(args.seq_len).expand(args.micro_batch, -1)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    (token_loss_sum(logits, ids) / ids.numel()).backward()
    del logits
    plan.strategy.clip_grad_norm(model, 1.0)
    opt.step()
    params, grads, optim_bytes = training_state_bytes(model, args.strategy, opt)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    mine = {"rank": env.rank, "strategy": plan.strategy.name, "n_params": n_params,
            "params_bytes": params, "grads_bytes": grads, "optim_bytes": optim_bytes,
            "params_bytes_after_load": params_loaded, "peak_rss_bytes": peak_rss,
            "rss_before_load": before["VmRSS"], "load_hwm": after["VmHWM"] if hwm_reset else None,
            "load_peak_bytes": (after["VmHWM"] - before["VmRSS"]) if hwm_reset else None,
            "load_anon_peak_bytes": anon.peak - before.get("RssAnon", 0), "hwm_reset": hwm_reset}
    gathered = [None] * env.world_size
    dist.all_gather_object(gathered, mine)
    if env.is_main:
        Path(args.out).write_text(json.dumps({"ranks": gathered, "world_size": env.world_size}, indent=1))
        print(json.dumps(gathered))
    distributed.shutdown()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--export", type=Path, help="write a random model (safetensors) here and exit")
    p.add_argument("--shape", default="{}", help="LlamaConfig kwargs as JSON (with --export)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, help="model directory to load (probe mode)")
    p.add_argument("--strategy", choices=["ddp", "fsdp", "fsdp2"], default="fsdp2")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.export:
        export(args.export, json.loads(args.shape), args.seed)
    else:
        probe(args)


if __name__ == "__main__":
    from llmtrain.distributed import hard_exit

    main()
    hard_exit(0)
