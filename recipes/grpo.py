#!/usr/bin/env python
"""DRAFT. Online RL with verifiable rewards (GRPO, DAPO, Dr. GRPO) of a causal LM with DDP, FSDP or FSDP2.

    torchrun --nproc_per_node=N recipes/grpo.py --config configs/demo-grpo.yaml [key.sub=value ...]

Written against the recipe API of recipes/dpo.py (trainer.build, trainer.loop with a step function) for
the lead to port. Its own parts: reading the prompts (load_prompts, until data.format=prompt exists in the
data registry), the step's prompts (PromptSteps), and the step: generate (llmtrain.generation), score
(llmtrain.rewards), advantages and loss (llmtrain.losses.policy).

Known gaps of this draft: num_iterations > 1 keeps the generation batch in memory only, so a resume in
the middle of its iterations samples it again from the updated weights (a checkpoint should carry it);
log.completions_every_steps and the TensorBoard text are not written; a RewardError stops the run as a
ConfigError (one line, exit 2).
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout, installed or not

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from llmtrain import distributed, generation, parallelize, rewards  # noqa: E402
from llmtrain import train as trainer  # noqa: E402
from llmtrain.config import ConfigError  # noqa: E402
from llmtrain.generate import stop_token_ids  # noqa: E402
from llmtrain.losses import policy  # noqa: E402
from llmtrain.losses.policy import GRPOConfig  # noqa: E402
from llmtrain.losses.token import TokenLoss, next_token_targets  # noqa: E402
from llmtrain.data.formats import IGNORE  # noqa: E402
from llmtrain.models import hf as model_lib, lora  # noqa: E402
from llmtrain.train.step import StepResult, update  # noqa: E402

USAGE = """\
GRPO / DAPO / Dr. GRPO with DDP, FSDP or FSDP2 on GPUs (NCCL) or CPUs (gloo). DRAFT.

  torchrun --nproc_per_node=N recipes/grpo.py --config configs/demo-grpo.yaml [key.sub=value ...]

data.path: JSON lines with a "prompt" (text, or a list of chat messages) and any other columns, which reach
the reward functions (grpo.reward_funcs) by name. Each step samples grpo.num_generations completions for
micro_batch_size x grad_accum_steps x world_size / num_generations prompts.
"""


def check(cfg: GRPOConfig) -> None:
    model_lib.check_paths(cfg.model, cfg.tokenizer.path)
    policy.check(cfg.grpo)
    rewards.load_all(cfg.grpo.reward_funcs)  # a missing module, file or function: exit 2 before any process
    if cfg.train.loss_impl == "liger":
        raise ConfigError("train.loss_impl: recipes/grpo.py takes chunked (the default) or full; liger yields no "
                          "per-token log-probs")
    if not cfg.data.path or not Path(cfg.data.path).is_file():
        raise ConfigError(f"data.path: recipes/grpo.py (draft) reads one JSON-lines file of prompts; got "
                          f"{cfg.data.path!r}")


def load_prompts(path: str, tokenizer, max_len: int) -> list[dict]:
    """Records -> {"ids", "prompt", "chat", "columns"}; a bad record is named by file:line."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        prompt = record.pop("prompt", None)
        if isinstance(prompt, list):
            ids = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
            ids = ids["input_ids"] if isinstance(ids, dict) else ids
        elif isinstance(prompt, str):
            ids = tokenizer(prompt)["input_ids"]
        else:
            raise ConfigError(f"{path}:{n}: no 'prompt' (text or a list of messages)")
        if len(ids) > max_len:
            raise ConfigError(f"{path}:{n}: prompt of {len(ids)} tokens > data.seq_len - grpo.max_completion_length "
                              f"= {max_len}")
        out.append({"ids": list(ids), "prompt": prompt, "chat": isinstance(prompt, list), "columns": record})
    return out


class PromptSteps:
    """The dataset indices of each step's prompts: one seeded order per epoch, whatever the world size; the
    same prompts for the num_iterations steps of one generation batch; the position is the steps done."""

    def __init__(self, n: int, per_step: int, seed: int, iterations: int, steps: int):
        self.n, self.per_step, self.seed, self.iterations, self.steps = n, per_step, seed, iterations, steps

    def indices(self, start: int) -> list[int]:
        out = []
        for i in range(start, start + self.per_step):
            epoch, k = divmod(i, self.n)
            order = list(range(self.n))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            out.append(order[k])
        return out

    def __next__(self) -> list[dict]:
        index = self.indices(self.steps // self.iterations * self.per_step)
        self.steps += 1
        return [{"prompt_index": torch.tensor(index)}]

    def position(self) -> dict:
        return {"steps": self.steps}


def all_gather_rows(t: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's equal-sized rows, in rank order."""
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def train(cfg: GRPOConfig, env: distributed.DistEnv) -> torch.nn.Module:
    run = trainer.build(cfg, env)
    model, plan, g = run.model, run.plan, cfg.grpo
    funcs = rewards.load_all(g.reward_funcs)
    tokenizer = run.tokenizer
    prompts = load_prompts(cfg.data.path, tokenizer, cfg.data.seq_len - g.max_completion_length)
    rows_per_rank = cfg.train.micro_batch_size * cfg.train.grad_accum_steps
    if run.global_batch % g.num_generations:
        raise ConfigError(f"micro_batch_size x grad_accum_steps x world size = {run.global_batch} completions per "
                          f"step must be a multiple of grpo.num_generations = {g.num_generations}")
    per_step = run.global_batch // g.num_generations
    generations = PromptSteps(len(prompts), per_step, cfg.train.seed, g.num_iterations, run.state.step)
    chat = prompts[0]["chat"]
    eos = stop_token_ids(run.token_loss.lm, tokenizer, chat)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    sampling = generation.Sampling(g.max_completion_length, g.temperature, g.top_p, g.top_k)
    names = [f.name for f in funcs]

    reference, ref_loss = None, None
    if g.beta:  # full fine-tuning: a frozen copy; LoRA: the same model with its adapters off
        reference = model if cfg.lora.enabled else trainer.build_frozen(run)
        ref_loss = run.token_loss if reference is model else TokenLoss(cfg.train.loss_impl, reference, env.device,
                                                                       cfg.train.loss_chunk_tokens)
    run.metrics.info(f"grpo: {len(prompts)} prompts, {per_step} x {g.num_generations} completions per step, "
                     f"loss {g.loss_type}, beta {g.beta:g}, rewards {', '.join(names)}, EOS ids {eos}")
    cache: dict = {}  # the generation batch, reused num_iterations times

    def logps_of(m, token_loss, batch, grad: bool) -> torch.Tensor:
        with (contextlib.nullcontext() if grad else torch.no_grad()), parallelize.autocast(plan, env.device):
            flat = token_loss.token_logps(m, batch, g.temperature)
        return policy.to_grid(flat, next_token_targets(batch["labels"]) != IGNORE)

    def generate_and_score(step: int, index: list[int]) -> dict:
        mine = slice(env.rank * rows_per_rank, (env.rank + 1) * rows_per_rank)
        rows = [(i, k) for i in index for k in range(g.num_generations)][mine]  # prompt-major
        ids = [prompts[i]["ids"] for i, _ in rows]
        keys = [(cfg.train.seed, step, i, k) for i, k in rows]
        t0 = time.perf_counter()
        with parallelize.autocast(plan, env.device):
            c = generation.generate(model, ids, keys, sampling, eos, pad, env.device)
        gen_s = time.perf_counter() - t0
        texts = [tokenizer.decode(r[:n], skip_special_tokens=True) for r, n in zip(c.ids.tolist(), c.lengths.tolist())]
        completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
        columns = {k: [prompts[i]["columns"].get(k) for i, _ in rows] for k in prompts[index[0]]["columns"]}
        try:
            per_func = rewards.score(funcs, [prompts[i]["prompt"] for i, _ in rows], completions,
                                     [r[:n] for r, n in zip(c.ids.tolist(), c.lengths.tolist())], columns,
                                     [i for i, _ in rows])
        except rewards.RewardError as e:
            raise ConfigError(str(e)) from None
        global_rewards = all_gather_rows(torch.tensor(per_func, device=env.device), env.world_size)
        adv = policy.group_advantages(global_rewards.cpu(), g.reward_weights, g.num_generations, g.scale_rewards)
        lengths = all_gather_rows(c.lengths.to(env.device), env.world_size).float()
        truncated = all_gather_rows(c.truncated.to(env.device), env.world_size)
        gen_tokens = distributed.all_reduce(c.lengths.sum().to(env.device)).item()
        gen_time = distributed.all_reduce(torch.tensor(gen_s, device=env.device), dist.ReduceOp.MAX).item()
        extra = {**policy.reward_metrics(global_rewards.cpu(), names, adv),
                 "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
                 "completions/max_length": lengths.max().item(),
                 "completions/clipped_ratio": truncated.float().mean().item(),
                 "generation_s": gen_time, "generated_tokens_per_s": gen_tokens / max(gen_time, 1e-9)}
        rows_all = generation.training_rows(ids, c, pad, g.mask_truncated_completions)
        micro = cfg.train.micro_batch_size
        batches = [{k: v[j:j + micro] for k, v in rows_all.items()} for j in range(0, rows_per_rank, micro)]
        advantages = adv.advantages[mine]
        for j, b in enumerate(batches):
            b = {k: v.to(env.device) for k, v in b.items()}
            batches[j] = b
            b["advantages"] = advantages[j * micro:(j + 1) * micro].to(env.device)
            if g.num_iterations > 1:  # the ratio's denominator: the weights that sampled
                b["old_logps"] = logps_of(model, run.token_loss, b, grad=False)
            if reference is not None:
                off = lora.adapters_disabled(model) if cfg.lora.enabled else contextlib.nullcontext()
                with off:
                    b["ref_logps"] = logps_of(reference, ref_loss, b, grad=False)
        return {"batches": batches, "extra": extra}

    def step(batches: list[dict]) -> StepResult:
        step_no = run.state.step
        generation_step = step_no // g.num_iterations
        if cache.get("step") != generation_step:
            cache.update(step=generation_step,
                         **generate_and_score(generation_step, batches[0]["prompt_index"].tolist()))
        rows = cache["batches"]
        keeps = [next_token_targets(b["labels"]) != IGNORE for b in rows]
        totals = distributed.all_reduce(torch.stack([policy.policy_counts(k) for k in keeps]).sum(0))
        loss_sum = torch.zeros((), device=env.device)
        summed = torch.zeros(len(policy.METRICS), device=env.device)
        minima = torch.full((2,), float("inf"), device=env.device)
        for i, (b, keep) in enumerate(zip(rows, keeps)):
            with parallelize.grad_sync(model, plan, enabled=i == len(rows) - 1):
                logps = logps_of(model, run.token_loss, b, grad=True)
                sums = policy.policy_sums(logps, keep, b["advantages"], b.get("old_logps"), b.get("ref_logps"),
                                          g.loss_type, g.epsilon, g.epsilon_high, g.beta, g.use_bias_correction_kl)
                part = policy.objective(sums, totals, g.loss_type, g.max_completion_length)
                # Data-parallel wrappers average gradients over ranks: x world size makes them the global sum's.
                (run.scaler.scale(part * env.world_size) if run.scaler else part * env.world_size).backward()
            loss_sum += part.detach()
            summed += sums.metrics
            minima = torch.minimum(minima, sums.minima)
        loss = distributed.all_reduce(loss_sum).item()
        extra = {**cache["extra"], **policy.metrics(distributed.all_reduce(summed),
                                                    distributed.all_reduce(minima, dist.ReduceOp.MIN), int(totals[1]),
                                                    g.beta)}
        grad_norm, ok = update(model, plan, run.opt, run.scaler, cfg.train.max_grad_norm, loss)
        batches[:] = [{k: b[k] for k in ("input_ids", "labels")} for b in rows]  # the loop's throughput counts these
        return StepResult(loss, grad_norm, int(totals[1]), ok, extra)

    return trainer.loop(run, generations, step)


def main(argv: list[str] | None = None) -> int:
    return trainer.main(argv, USAGE, GRPOConfig, train, check)


if __name__ == "__main__":
    distributed.hard_exit(main())
