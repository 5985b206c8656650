"""The two sides of the distill benchmark (bench/benchmarks/distill/), each run under torchrun (2 ranks, gloo):

    torchrun --standalone --nproc_per_node=2 bench/benchmarks/distill/worker.py recipe --cpu-log DIR -- RECIPE_ARGS ...
    torchrun --standalone --nproc_per_node=2 bench/benchmarks/distill/worker.py full --config CFG --student DIR \\
        --teacher DIR --beta B --steps N --out R.json

recipe  recipes/distill.py itself (llmtrain.recipes.distill.Distill().main(RECIPE_ARGS)); after every optimizer
        step each rank appends its CPU seconds (user + system, and system) and peak RSS to DIR/cpu_rank<R>.jsonl (the
        training loop's Throughput.add, wrapped here: the recipe is not changed). Its metrics.jsonl gives the
        wall step time (rank 0) and mem_gb.
full    what a user of TRL's GKDTrainer runs without Liger (its compute_loss): the student's and the teacher's
        whole [tokens x vocab] logits from their forwards (the teacher's under no_grad), TRL's
        generalized_jsd_loss on them, backward, the gradient all-reduce, clipping, AdamW. The same model
        directories and the same micro-batches (llmtrain.data, the recipe's order) as the recipe.

The full side's two ranks take turns through forward, loss and backward (a barrier between turns), so that the
machine holds one rank's logits at a time: at 131k ids and 2048 tokens one rank peaks near 11 GiB, and two at
once would not fit the 23 GiB this benchmark was written for. Each rank's peak is what it is either way (its own
tensors); its step time is its own turn plus the all-reduce and the optimizer step, i.e. a step with a core to
itself, which is what the recipe's concurrent ranks have on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu() -> tuple[float, float]:
    """This process's CPU seconds so far: (user + system, system). System time is mostly page faults here: every
    fresh [tokens x vocab] tensor is new memory the kernel zeroes."""
    t = os.times()
    return t.user + t.system, t.system


# -- recipe: recipes/distill.py with CPU time per step -------------------------------------------

def recipe(cpu_log: Path, argv: list[str]) -> int:
    from llmtrain.metrics import Throughput
    from llmtrain.recipes.distill import Distill

    path = cpu_log / f"cpu_rank{os.environ['RANK']}.jsonl"
    add = Throughput.add

    def add_and_log(self, batches, step_time):
        add(self, batches, step_time)
        with path.open("a") as f:
            total, system = cpu()
            f.write(json.dumps({"cpu_s": total, "sys_s": system, "peak_rss": peak_rss()}) + "\n")

    Throughput.add = add_and_log
    return Distill().main(argv)


# -- full: the full-logits KD loop ---------------------------------------------------------------

def generalized_jsd_loss(student_logits, teacher_logits, labels, beta, temperature):
    """TRL's GKDTrainer.generalized_jsd_loss with reduction "batchmean", re-implemented op for op (huggingface/trl,
    trl/experimental/gkd/gkd_trainer.py; read at commit 054a0dab, the function tests/scripts/trl_gkd_parity.py
    checked in TRL 1.16.0): the same tensors, alive as long as in TRL (the scaled logits and both KL terms are
    held to the end of the function), so the memory is TRL's. Its parity with llmtrain's loss is that script's."""
    student_scaled = student_logits / temperature  # TRL rebinds its arguments: both copies live to the return
    teacher_scaled = teacher_logits / temperature
    student_logps = F.log_softmax(student_scaled, dim=-1)
    teacher_logps = F.log_softmax(teacher_scaled, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_logps, teacher_logps, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_logps, student_logps, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=student_logps.dtype, device=student_logps.device)
        mixture = torch.logsumexp(torch.stack([student_logps + torch.log1p(-b), teacher_logps + torch.log(b)]), dim=0)
        kl_teacher = F.kl_div(mixture, teacher_logps, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture, student_logps, reduction="none", log_target=True)
        jsd = b * kl_teacher + (1 - b) * kl_student
    mask = labels != -100
    jsd = jsd[mask]
    return jsd.sum() / mask.sum()


def compute_loss(student, teacher, batch: dict, beta: float, temperature: float) -> torch.Tensor:
    """GKDTrainer.compute_loss's non-Liger path: both forwards return whole logits; its shift (prompt length 1:
    packed text rows train every position) and loss. The outputs are dropped on return, as there."""
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    student_out = student(**inputs)
    with torch.no_grad():
        teacher_out = teacher(**inputs)
    return generalized_jsd_loss(student_out.logits[:, :-1, :], teacher_out.logits[:, :-1, :], batch["labels"][:, 1:],
                                beta, temperature)


def full(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    from llmtrain import data
    from llmtrain.config import load_config
    from llmtrain.models import hf
    from llmtrain.recipes.distill import DistillConfig

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_config(args.config, [], DistillConfig)
    t = cfg.train
    tokenizer = hf.load_tokenizer(cfg.tokenizer.path, False)
    built = data.build(cfg.data, tokenizer, t.seed, rank == 0, rank, world)
    steps = data.make_steps(built, t.micro_batch_size, t.grad_accum_steps, world, rank, t.seed, torch.device("cpu"),
                            {})
    student = AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).eval().requires_grad_(False)
    student.train()
    params = [p for p in student.parameters() if p.requires_grad]
    for p in params:  # DDP's first broadcast (the weights are one directory's already)
        dist.broadcast(p.data, 0)
    opt = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, fused=True)
    setup_rss = peak_rss()
    records = []
    for _ in range(args.steps):
        micro = next(steps)
        own_wall = own_cpu = own_sys = 0.0
        tokens = 0
        for batch in micro:
            batch = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids", "labels")}
            tokens += int((batch["labels"][:, 1:] != -100).sum())
            for turn in range(world):
                if turn == rank:
                    w, (c, k) = time.perf_counter(), cpu()
                    loss = compute_loss(student, teacher, batch, args.beta, cfg.distill.temperature)
                    (loss / len(micro)).backward()
                    own_wall += time.perf_counter() - w
                    total, system = cpu()
                    own_cpu += total - c
                    own_sys += system - k
                    del loss
                dist.barrier()
        w, (c, k) = time.perf_counter(), cpu()
        for p in params:  # DDP's averaged gradients (it buckets them; the same bytes)
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total, system = cpu()
        records.append({"wall_s": own_wall + time.perf_counter() - w, "cpu_s": own_cpu + total - c,
                        "sys_s": own_sys + system - k, "tokens": tokens})
    mine = {"rank": rank, "peak_rss": peak_rss(), "setup_peak_rss": setup_rss, "steps": records}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"ranks": ranks, "beta": args.beta, "world": world}, indent=1))
        print(f"full-logits KD, beta {args.beta}: step wall s "
              f"{[round(statistics.median(r['wall_s'] for r in x['steps'][1:] or x['steps']), 2) for x in ranks]}, "
              f"peak RSS GiB {[round(x['peak_rss'] / 2**30, 2) for x in ranks]}", flush=True)
    dist.destroy_process_group()


def main() -> int:
    if sys.argv[1:2] == ["recipe"]:
        p = argparse.ArgumentParser()
        p.add_argument("--cpu-log", type=Path, required=True)
        rest = sys.argv[2:]
        split = rest.index("--")
        args = p.parse_args(rest[:split])
        return recipe(args.cpu_log, rest[split + 1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("side", choices=["full"])
    p.add_argument("--config", required=True, help="the recipe's config (data, seed, micro-batch, lr)")
    p.add_argument("--student", required=True)
    p.add_argument("--teacher", required=True)
    p.add_argument("--beta", type=float, default=0.0, help="TRL's beta: 0 forward KL, 1 reverse KL, else JSD")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", required=True)
    full(p.parse_args())
    return 0


if __name__ == "__main__":
    from llmtrain import distributed

    distributed.hard_exit(main())
