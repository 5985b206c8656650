"""Online RL with verifiable rewards (recipes/grpo.py): GRPO, DAPO, Dr. GRPO.

What is this recipe's own (docs/grpo.md): the grpo: section; the step's prompts (data.format: prompt; every
rank gets all of them, the same for grpo.num_iterations steps); and the step: sample the completions
(llmtrain.rollout.local, keyed by (seed, generation batch, prompt, generation index)), score them
(llmtrain.rewards), group-relative advantages over every rank's rewards, then the clipped surrogate
(llmtrain.losses.policy) through the shared accumulation, num_iterations times on the same completions.
The generation batch is registered state with num_iterations > 1, so a resume in its middle continues on
the same completions and sampling-time log-probs. The rest is llmtrain.train's (llmtrain/recipes/base.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from llmtrain import distributed, rewards
from llmtrain.config import Config, ConfigError, ranged
from llmtrain.data import IGNORE
from llmtrain.losses import policy
from llmtrain.losses.token import next_token_targets
from llmtrain.models import hf as model_lib
from llmtrain.recipes.base import Recipe
from llmtrain.rollout import local as generation
from llmtrain.train.build import Registered, data_steps, reference
from llmtrain.train.step import Share, accumulate

USAGE = """\
GRPO / DAPO / Dr. GRPO with DDP, FSDP or FSDP2 on GPUs (NCCL) or CPUs (gloo).

  torchrun --nproc_per_node=N recipes/grpo.py --config configs/demo-grpo.yaml [key.sub=value ...]

The data are prompts (data.format: prompt): {"prompt": text or a list of messages, ...}; every other column
reaches the reward functions (grpo.reward_funcs) by name. Each step trains on micro_batch_size x
grad_accum_steps x world size completions: that many / grpo.num_generations prompts, each sampled
grpo.num_generations times. data.seq_len is the prompt's budget (longer prompts keep their last tokens).

Writes to output_dir what recipes/finetune.py writes; metrics.jsonl adds TRL's names: reward, reward_std,
rewards/<func>/mean and /std, frac_reward_zero_std, kl (grpo.beta > 0), completions/mean_length, /min_length,
/max_length, /clipped_ratio, clip_ratio/low_mean, /high_mean, /region_mean, and generation_s,
generated_tokens_per_s; log.completions_every_steps: sampled completions to output_dir/completions.jsonl.
"""
LOGGED_PROMPTS = 4  # prompts (each with all its completions) per completions.jsonl record set



@dataclass
class GRPOSection:
    num_generations: int = ranged("[2, inf)", default=8)
    """G: completions sampled per prompt (>= 2); a group's advantages are relative to its own mean."""
    max_completion_length: int = ranged("[1, inf)", default=256)
    """Tokens sampled per completion at most; also dr_grpo's constant denominator."""
    temperature: float = ranged("(0, inf)", default=1.0)
    """Sampling temperature; the log-probs of the loss use the same (logits / temperature, as TRL)."""
    top_p: float = ranged("(0, 1]", default=1.0)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1: off)."""
    top_k: int = ranged("[0, inf)", default=0)
    """Keep the top_k most likely tokens only (0: off)."""
    epsilon: float = ranged("[0, 1)", default=0.2)
    """Lower clipping bound of the ratio: 1 - epsilon."""
    epsilon_high: float | None = ranged("[0, inf)", default=None)
    """Upper clipping bound: 1 + epsilon_high (None: epsilon; DAPO's clip-higher uses 0.28)."""
    beta: float = ranged("[0, inf)", default=0.0)
    """KL penalty to the reference model (k3 estimator); 0 builds no reference."""
    use_bias_correction_kl: bool = True
    """beta > 0: multiply the per-token KL by the importance ratio (TRL 1.16's default, DeepSeek-V3.2)."""
    num_iterations: int = ranged("[1, inf)", default=1)
    """Updates per generation batch (mu); > 1 takes the ratio against the log-probs at sampling time."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """How per-token losses are aggregated (llmtrain/losses/policy.py's docstring): grpo (mean per completion,
    then over completions) | bnpo, dapo (mean over the global batch's tokens) | dr_grpo (sum / (completions x
    max_completion_length))."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantage scaling: divide by the group's reward std (group), the batch's (batch) or not at all (none,
    Dr. GRPO's recommendation)."""
    mask_truncated_completions: bool = False
    """Leave completions that reached max_completion_length without an EOS out of the loss (DAPO)."""
    reward_funcs: list[str] = field(default_factory=list)
    """Reward functions, "package.module:function" or "path/to/file.py:function", each called as TRL does:
    f(prompts, completions, completion_ids, **columns) -> list[float | None]. Built-ins:
    llmtrain.rewards:exact_answer, llmtrain.rewards:format_regex."""
    reward_weights: list[float] = ranged("[0, inf)", default_factory=list)
    """One weight per reward function (empty: all 1); a penalty is a function returning negative rewards."""


@dataclass
class GRPOConfig(Config):
    """recipes/grpo.py's Config: the shared sections plus grpo:."""
    grpo: GRPOSection = field(default_factory=GRPOSection)


def check(section: GRPOSection) -> None:
    """Set-up checks, naming the grpo.* keys."""
    s = section
    if s.num_generations < 2:
        raise ConfigError("grpo.num_generations must be >= 2 (advantages are relative to the group's mean)")
    for key in ("max_completion_length", "num_iterations"):
        if getattr(s, key) < 1:
            raise ConfigError(f"grpo.{key} must be >= 1")
    if s.temperature <= 0:
        raise ConfigError("grpo.temperature must be > 0")
    if not 0 < s.top_p <= 1:
        raise ConfigError("grpo.top_p must be in (0, 1]")
    if s.top_k < 0:
        raise ConfigError("grpo.top_k must be >= 0 (0: off)")
    if not 0 <= s.epsilon < 1:
        raise ConfigError("grpo.epsilon must be in [0, 1)")
    if s.epsilon_high is not None and s.epsilon_high < 0:
        raise ConfigError("grpo.epsilon_high must be >= 0")
    if s.beta < 0:
        raise ConfigError("grpo.beta must be >= 0")
    if s.loss_type not in policy.LOSS_TYPES:
        raise ConfigError(f"grpo.loss_type: {s.loss_type!r} is not a valid choice; choose one of "
                          f"{', '.join(policy.LOSS_TYPES)}")
    if s.scale_rewards not in policy.SCALE_REWARDS:
        raise ConfigError(f"grpo.scale_rewards: {s.scale_rewards!r} is not a valid choice; choose one of "
                          f"{', '.join(policy.SCALE_REWARDS)}")
    if not s.reward_funcs:
        raise ConfigError("grpo.reward_funcs: name at least one reward function, e.g. [llmtrain.rewards:exact_answer]")
    if s.reward_weights and len(s.reward_weights) != len(s.reward_funcs):
        raise ConfigError(f"grpo.reward_weights: {len(s.reward_weights)} weights for {len(s.reward_funcs)} "
                          "grpo.reward_funcs; give one per function")


class PromptSteps:
    """Each generation batch's prompts (every rank gets them all), the same for num_iterations steps. The
    position is the batch's first sample and the iteration within it: a resume in its middle takes the same
    prompts again."""

    def __init__(self, steps, iterations: int, position: dict):
        self.steps, self.iterations = steps, iterations
        self.iteration, self.start, self.batch = position.get("iteration", 0), steps.samples_seen, None

    def __next__(self) -> list[dict]:
        if self.batch is None or self.iteration == 0:
            self.start, self.batch = self.steps.samples_seen, next(self.steps)
        self.iteration = (self.iteration + 1) % self.iterations
        return self.batch  # one batch: the step's prompts

    def position(self) -> dict:
        return {"samples_seen": self.steps.samples_seen if self.iteration == 0 else self.start,
                "iteration": self.iteration}


class Generated:
    """The generation batch that the next updates reuse (num_iterations > 1), every rank's, JSON-able:
    completion token ids, truncation, advantages, sampling-time and reference log-probs of the trained
    tokens, the batch's metrics."""

    def __init__(self):
        self.state: dict = {}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


class GRPO(Recipe):
    name = "grpo"
    config_cls = GRPOConfig
    usage = USAGE
    rows = "prompts"
    unit = "completions"

    def check(self, cfg: GRPOConfig) -> None:
        self.check_existing_model(cfg, "configs/demo-grpo.yaml")
        check(cfg.grpo)
        rewards.load_all(cfg.grpo.reward_funcs)  # a missing module, file or function: exit 2 here
        if cfg.train.loss_impl == "liger":
            raise ConfigError("train.loss_impl: recipes/grpo.py takes chunked (the default) or full; liger yields "
                              "no per-token log-probs")

    def registered(self, cfg: GRPOConfig) -> list[Registered]:
        self.generated = Generated()
        return [Registered("grpo_generation", self.generated)] if cfg.grpo.num_iterations > 1 else []

    def steps(self, run):
        g = run.cfg.grpo
        if run.global_batch % g.num_generations:
            raise ConfigError(f"train.micro_batch_size x train.grad_accum_steps x {run.env.world_size} ranks = "
                              f"{run.global_batch} completions per step must be a multiple of "
                              f"grpo.num_generations = {g.num_generations}")
        built, prompts = data_steps(run, self.unit, rows_per_step=run.global_batch // g.num_generations)
        return built, PromptSteps(prompts, g.num_iterations, run.state.data)

    def setup(self, run, built) -> None:
        super().setup(run, built)
        g, tok = run.cfg.grpo, run.tokenizer
        self.section, self.objective, self.micro = g, self, None
        self.funcs = rewards.load_all(g.reward_funcs)
        self.eos = model_lib.stop_ids(run.model_config.eos_token_id, tok)
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else self.eos[0]
        self.sampling = generation.Sampling(g.max_completion_length, g.temperature, g.top_p, g.top_k)
        self.reference = reference(run) if g.beta else None
        run.metrics.info(f"grpo: {run.global_batch // g.num_generations} prompts x {g.num_generations} completions "
                         f"per step, loss {g.loss_type}, beta {g.beta:g}"
                         f"{f' (reference: {self.reference.kind})' if self.reference else ''}, "
                         f"{g.num_iterations} update(s) per generation batch, rewards "
                         f"{', '.join(f.spec for f in self.funcs)}, EOS ids {self.eos}")

    # -- the step ---------------------------------------------------------------------------------
    def step(self, batches: list[dict]):
        run, g = self.run, self.section
        prompts, index = batches[0], run.state.step // g.num_iterations
        if self.micro is None or self.generated.state.get("step") != index:
            held = self.generated.state if self.generated.state.get("step") == index else None
            self.micro, metrics = self.restore(prompts, held) if held else self.generate(prompts, index)
            self.metrics = metrics
        result = accumulate(run.stepper, self.micro, self)
        return result._replace(extra={**self.metrics, **result.extra}, rows=self.micro)

    def mine(self) -> range:
        """This rank's completions in the step's global order (prompt-major: prompt c // G, generation c % G)."""
        per_rank = self.run.cfg.train.micro_batch_size * self.run.cfg.train.grad_accum_steps
        return range(self.run.env.rank * per_rank, (self.run.env.rank + 1) * per_rank)

    def generate(self, prompts: dict, index: int) -> tuple[list[dict], dict]:
        run, g, env = self.run, self.section, self.run.env
        G, rows = g.num_generations, self.mine()
        prompt_index = [int(prompts["prompt_index"][c // G]) for c in rows]
        ids = [prompts["prompt_ids"][c // G] for c in rows]
        t0 = time.perf_counter()
        with run.autocast():
            out = generation.generate(run.model, ids, [(run.cfg.train.seed, index, p, c % G)
                                                       for p, c in zip(prompt_index, rows)],
                                      self.sampling, self.eos, self.pad, env.device)
        seconds = time.perf_counter() - t0
        tokens = [r[:n] for r, n in zip(out.ids.tolist(), out.lengths.tolist())]
        texts = run.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        chat = [isinstance(prompts["prompts"][c // G], list) for c in rows]
        completions = [[{"role": "assistant", "content": t}] if is_chat else t for t, is_chat in zip(texts, chat)]
        columns = [prompts["columns"][c // G] for c in rows]
        names = sorted({k for c in columns for k in c})
        per_func = self.score([prompts["prompts"][c // G] for c in rows], completions, tokens,
                              {k: [c.get(k) for c in columns] for k in names}, prompt_index)
        every = lambda t: gather_rows(t.to(env.device)).cpu()  # noqa: E731
        scores, lengths, truncated = every(per_func), every(out.lengths), every(out.truncated.long())
        adv = policy.group_advantages(scores, g.reward_weights, G, g.scale_rewards)
        generated = distributed.all_reduce(out.lengths.sum().to(env.device)).item()
        seconds = distributed.all_reduce(torch.tensor(seconds, device=env.device), dist.ReduceOp.MAX).item()
        metrics = {**policy.reward_metrics(scores, [f.name for f in self.funcs], adv),
                   "completions/mean_length": lengths.float().mean().item(),
                   "completions/min_length": lengths.min().item(), "completions/max_length": lengths.max().item(),
                   "completions/clipped_ratio": truncated.float().mean().item(),
                   "generation_s": seconds, "generated_tokens_per_s": generated / max(seconds, 1e-9)}
        advantages = adv.advantages[rows.start:rows.stop].tolist()
        micro = self.batches(prompts, tokens, out.truncated.tolist(), advantages)
        old, ref = self.score_logps(micro)
        every_n = run.cfg.log.completions_every_steps
        if every_n and index % every_n == 0:
            self.log_completions(rows, prompt_index, prompts, texts, tokens, out.truncated.tolist(), per_func,
                                 adv, run.state.step + 1)
        if g.num_iterations > 1:  # every rank's part, for a checkpoint in the middle of the batch
            parts = [None] * env.world_size
            dist.all_gather_object(parts, (tokens, out.truncated.tolist(), old, ref))
            self.generated.state = {"step": index, "advantages": adv.advantages.tolist(), "metrics": metrics,
                                    **{k: sum((p[i] for p in parts), []) if parts[0][i] is not None else None
                                       for i, k in enumerate(("completions", "truncated", "old", "ref"))}}
        return micro, metrics

    def restore(self, prompts: dict, held: dict) -> tuple[list[dict], dict]:
        """A resume in the middle of a generation batch: this rank's micro-batches from the checkpoint's."""
        rows = self.mine()
        part = {k: held[k][rows.start:rows.stop] if held[k] is not None else None
                for k in ("completions", "truncated", "advantages", "old", "ref")}
        micro = self.batches(prompts, part["completions"], part["truncated"], part["advantages"])
        n = self.run.cfg.train.micro_batch_size
        for i, b in enumerate(micro):
            for key, name in (("old", "old_logps"), ("ref", "ref_logps")):
                if part[key] is not None:
                    flat = torch.tensor(sum(part[key][i * n:(i + 1) * n], []), device=b["labels"].device)
                    b[name] = policy.to_grid(flat, self.keep(b))
        return micro, held["metrics"]

    def score(self, prompts, completions, tokens, columns, prompt_index) -> torch.Tensor:
        """[completions, functions] rewards; a reward function's failure on any rank stops every rank with its
        one line (rewards.RewardError: exit 1), before anything of this step is saved."""
        error, per_func = None, None
        try:
            per_func = torch.tensor(rewards.score(self.funcs, prompts, completions, tokens, columns, prompt_index),
                                    dtype=torch.float64)
        except rewards.RewardError as e:
            error = str(e)
        errors = [None] * self.run.env.world_size
        dist.all_gather_object(errors, error)
        if failed := next((e for e in errors if e), None):
            raise rewards.RewardError(failed)
        return per_func

    def batches(self, prompts: dict, tokens: list[list[int]], truncated: list[bool],
                advantages: list[float]) -> list[dict]:
        """This rank's micro-batches of training rows (prompt + completion) with their advantages."""
        g, n, rows = self.section, self.run.cfg.train.micro_batch_size, self.mine()
        ids = [prompts["prompt_ids"][c // g.num_generations] for c in rows]
        out = []
        for i in range(0, len(rows), n):
            done = generation.from_lists(tokens[i:i + n], truncated[i:i + n], self.pad)
            b = generation.training_rows(ids[i:i + n], done, self.pad, g.mask_truncated_completions)
            out.append({**{k: v.to(self.run.env.device) for k, v in b.items()},
                        "advantages": torch.tensor(advantages[i:i + n], device=self.run.env.device)})
        return out

    def score_logps(self, micro: list[dict]) -> tuple[list | None, list | None]:
        """Sampling-time log-probs (num_iterations > 1: the ratio's denominator) and the reference's (beta > 0)
        of each micro-batch's trained tokens, set on the batches; -> per completion lists (for Generated)."""
        run, g = self.run, self.section
        kept = {}
        for name, wanted, model_logps in (
                ("old_logps", g.num_iterations > 1, lambda b: run.token_loss.token_logps(run.model, b, g.temperature)),
                ("ref_logps", g.beta > 0, lambda b: self.reference.logps(
                    lambda model, token_loss: token_loss.token_logps(model, b, g.temperature)))):
            if not wanted:
                continue
            kept[name] = []
            for b in micro:
                with torch.no_grad(), run.autocast():
                    b[name] = policy.to_grid(model_logps(b), self.keep(b))
                kept[name] += [row[k].tolist() for row, k in zip(b[name], self.keep(b))]
        return kept.get("old_logps"), kept.get("ref_logps")

    def log_completions(self, rows, prompt_index, prompts, texts, tokens, truncated, per_func, adv, step) -> None:
        """The first LOGGED_PROMPTS prompts' completions, their rewards and advantages -> completions.jsonl."""
        G, names = self.section.num_generations, [f.name for f in self.funcs]
        records = [{"step": step, "prompt_index": p, "generation": c % G, "prompt": prompts["prompts"][c // G],
                    "completion": text, "tokens": len(ids), "truncated": cut,
                    "rewards": {n: None if v != v else v for n, v in zip(names, scores.tolist())},
                    "reward": float(adv.rewards[c]), "advantage": float(adv.advantages[c])}
                   for c, p, text, ids, cut, scores in zip(rows, prompt_index, texts, tokens, truncated, per_func)
                   if c // G < LOGGED_PROMPTS]
        parts = [None] * self.run.env.world_size
        dist.all_gather_object(parts, records)
        if self.run.env.is_main:
            with open(Path(self.run.cfg.output_dir) / "completions.jsonl", "a") as f:
                f.writelines(json.dumps(r) + "\n" for part in parts for r in part)

    # -- the objective: sums over a micro-batch's completions / the step's completions and tokens --------
    @staticmethod
    def keep(batch: dict) -> torch.Tensor:
        return next_token_targets(batch["labels"]) != IGNORE

    def counts(self, batch: dict) -> torch.Tensor:
        return policy.policy_counts(self.keep(batch))

    def share(self, model, batch: dict, totals: torch.Tensor) -> Share:
        g, keep = self.section, self.keep(batch)
        logps = policy.to_grid(self.run.token_loss.token_logps(model, batch, g.temperature), keep)
        sums = policy.policy_sums(logps, keep, batch["advantages"], batch.get("old_logps"), batch.get("ref_logps"),
                                  g.loss_type, g.epsilon, g.epsilon_high, g.beta, g.use_bias_correction_kl)
        part = policy.objective(sums, totals[1:], g.loss_type, g.max_completion_length)
        return Share(part, torch.cat([part.detach().reshape(1), sums.metrics]))

    def report(self, metrics: torch.Tensor, totals: torch.Tensor) -> tuple[float, dict]:
        return metrics[0].item(), policy.metrics(metrics[1:], None, int(totals[2]), self.section.beta)


def gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Every rank's equal-sized rows, in rank order."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)

