"""GRPO's recipe (llmtrain.recipes.grpo's docstring): its batch source (Rollouts: the step's prompts, PromptSteps ->
the engine's completions -> scores -> training rows), its objective (PolicyObjective) and the GRPO Recipe."""

from __future__ import annotations

import dataclasses
import time

import torch

from llmtrain import data, distributed, rewards
from llmtrain.losses import policy
from llmtrain.models import ulysses
from llmtrain.recipes.base import Recipe
from llmtrain.recipes.grpo.config import USAGE, GRPOConfig, GRPOSection, check, check_batch
from llmtrain.rollout.agent import Agent, Environments, ToolUse
from llmtrain.rollout.engine import Sampling
from llmtrain.rollout.record import CompletionLog, completion_metrics, tool_metrics
from llmtrain.rollout.registry import Rollout, build as build_rollout
from llmtrain.rollout.rows import (GenerationBatch, attach_logps, attach_saved_logps, completion_mask, policy_rows,
                                   reference_logps, trainer_logps)
from llmtrain.rollout.scoring import ModelReward, Scorer
from llmtrain.rollout.section import check_engine
from llmtrain.rollout.tools import CallParser, load_tools
from llmtrain.train.build import Run, build_data
from llmtrain.train.frozen import FrozenModel, reference, reward_model
from llmtrain.train.source import Batch
from llmtrain.train.step import Share


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


class PolicyObjective:
    """The clipped surrogate as sums over a micro-batch's completions / the step's completions and tokens."""

    def __init__(self, section: GRPOSection, token_loss):
        self.section, self.token_loss = section, token_loss

    def counts(self, batch: dict) -> torch.Tensor:
        return policy.policy_counts(completion_mask(batch))

    def share(self, model, batch: dict, totals: torch.Tensor) -> Share:
        g, trained = self.section, completion_mask(batch)
        logps = policy.to_grid(self.token_loss.token_logps(model, batch, g.temperature), trained)
        sums = policy.policy_sums(logps, trained, batch["advantages"], batch.get("old_logps"),
                                  batch.get("ref_logps"), g.loss_type, g.epsilon, g.epsilon_high, g.beta,
                                  g.use_bias_correction_kl, batch["engine_logps"], g.importance_correction,
                                  g.importance_cap, g.importance_level)
        part = policy.objective(sums, totals[1:], g.loss_type, g.max_completion_length)
        return Share(part, torch.cat([part.detach().reshape(1), sums.metrics, sums.drift]), minima=sums.drift_minima)

    def report(self, metrics: torch.Tensor, totals: torch.Tensor) -> tuple[float, dict]:
        n, minima = 1 + len(policy.METRICS), -3  # then the drift's 4 sums, then its 3 minima (Share.minima)
        return metrics[0].item(), {**policy.metrics(metrics[1:n], None, int(totals[2]), self.section.beta),
                                   **policy.drift_metrics(metrics[n:minima], metrics[minima:])}


class Rollouts:
    """GRPO's batch source: per generation batch, this rank's completions of the step's prompts from the engine
    (after the weight push), their scores and group-relative advantages over every rank's, and the training rows
    (with the sampling-time log-probs when num_iterations > 1, the reference's when beta > 0), reused
    num_iterations times. Its state (num_iterations > 1) is the generation batch, every rank's
    (rows.GenerationBatch)."""

    def __init__(self, run: Run, prompts: PromptSteps, rollout: Rollout, scorer: Scorer, ref: FrozenModel | None,
                 tool_use: ToolUse | None):
        self.run, self.section, self.prompts, self.rollout, self.scorer = run, run.cfg.grpo, prompts, rollout, scorer
        self.ref, self.held, self.tool_use = ref, None, tool_use
        g = self.section
        self.sampling = Sampling(g.max_completion_length, g.temperature, g.top_p, g.top_k)
        self.log = CompletionLog(run.cfg.output_dir, run.env.is_main, g.num_generations, [f.name for f in scorer.funcs])
        per_rank = run.cfg.train.micro_batch_size * run.cfg.train.grad_accum_steps
        self.rows = range(run.env.rank * per_rank, (run.env.rank + 1) * per_rank)  # this rank's, in the global order
        self.micro, self.metrics = None, {}

    # -- BatchSource ------------------------------------------------------------------------------
    def next(self) -> Batch:
        prompts, index = next(self.prompts)[0], self.run.state.step // self.section.num_iterations
        t0 = time.perf_counter()
        if self.micro is None or self.held is None or self.held.step != index:
            restored = self.held is not None and self.held.step == index
            self.micro, self.metrics = self.restore(prompts) if restored else self.generate(prompts, index)
        return Batch(self.micro, self.metrics, time.perf_counter() - t0)

    def position(self) -> dict:
        return self.prompts.position()

    def state_dict(self) -> dict:
        return {} if self.held is None else dataclasses.asdict(self.held)

    def load_state_dict(self, state: dict) -> None:
        self.held = GenerationBatch.from_state(state) if state else None

    # -- a generation batch -----------------------------------------------------------------------
    def generate(self, prompts: dict, index: int) -> tuple[list[dict], dict]:
        run, g, rows, step = self.run, self.section, self.rows, self.run.state.step
        G, cfg = g.num_generations, run.cfg
        self.rollout.weights.push(step)
        keys = [(cfg.train.seed, index, int(prompts["prompt_index"][c // G]), c % G) for c in rows]
        prompt_ids, messages, extra = [prompts["prompt_ids"][c // G] for c in rows], None, {}
        if self.tool_use is None:
            out = self.rollout.engine.generate(prompt_ids, keys, self.sampling)
        else:
            self.tool_use.check_prompts(prompts["prompts"], prompts["prompt_index"].tolist())
            at = [c // G for c in rows]
            episode = self.tool_use.run(self.rollout.engine, [prompts["prompts"][i] for i in at],
                                        [prompts["columns"][i] for i in at],
                                        [int(prompts["prompt_index"][i]) for i in at], keys, self.sampling)
            out, messages, prompt_ids = episode.trajectories.completions, episode.trajectories.messages, \
                episode.prompt_ids
            extra = {} if episode.environments is None else {"environments": episode.environments}
        texts = run.tokenizer.batch_decode(out.tokens, skip_special_tokens=True)
        scores = self.scorer.score(prompts, rows, out.tokens, texts, step + 1, messages, extra)
        if scores.note:
            run.metrics.info(scores.note)
        metrics = {**scores.metrics, **completion_metrics(out, run.env.device)}
        if self.tool_use is not None:
            t = episode.trajectories
            metrics |= tool_metrics(t.calls, t.failures, t.turns, run.env.device)
        advantages = scores.advantages.advantages[rows.start:rows.stop].tolist()
        # Sampled per rank; under parallel.sp_size every rank of a sequence group trains on all of the group's rows
        sp = run.env.sp_group
        micro = ulysses.group_batches(sp, self.training_rows(prompt_ids, out.tokens, out.truncated, advantages,
                                                             out.logps, out.tool_mask))
        t = g.temperature
        old = (attach_logps(micro, "old_logps", trainer_logps(run.token_loss, run.model, run.autocast, micro, t))
               if g.num_iterations > 1 else None)
        ref = attach_logps(micro, "ref_logps", reference_logps(self.ref, micro, t)) if self.ref else None
        every_n = cfg.log.completions_every_steps
        if every_n and index % every_n == 0:
            self.log.write(step + 1, prompts, rows, texts, out, scores.per_func, scores.advantages, messages)
        if g.num_iterations > 1:  # every rank's part, for a checkpoint in the middle of the batch
            self.held = GenerationBatch.gathered(index, out.tokens, out.truncated,
                                                 scores.advantages.advantages.tolist(), ulysses.own_part(sp, old),
                                                 ulysses.own_part(sp, ref), out.logps, metrics,
                                                 out.tool_mask, prompt_ids if self.tool_use else None)
        return micro, metrics

    def restore(self, prompts: dict) -> tuple[list[dict], dict]:
        """A resume in the middle of a generation batch: this rank's micro-batches from the checkpoint's."""
        part = self.held.part(self.rows)
        G = self.section.num_generations
        prompt_ids = part.prompt_ids or [prompts["prompt_ids"][c // G] for c in self.rows]
        micro = self.training_rows(prompt_ids, part.completions, part.truncated, part.advantages, part.engine,
                                   part.tool_mask)
        for name, saved in (("old_logps", part.old), ("ref_logps", part.ref)):
            if saved is not None:
                attach_saved_logps(micro, name, saved, self.run.cfg.train.micro_batch_size)
        return ulysses.group_batches(self.run.env.sp_group, micro), part.metrics

    def training_rows(self, prompt_ids: list[list[int]], tokens: list[list[int]], truncated: list[bool],
                      advantages: list[float], engine_logps: list[list[float]],
                      tool_mask: list[list[int]] | None) -> list[dict]:
        """This rank's micro-batches of training rows (rows.policy_rows): completion i of prompt_ids[i]."""
        return policy_rows(prompt_ids, tokens, truncated, advantages, engine_logps, self.rows,
                           self.run.cfg.train.micro_batch_size, self.rollout.pad_id,
                           self.section.mask_truncated_completions, self.run.env.device, tool_mask)


class GRPO(Recipe):
    name = "grpo"
    config_cls = GRPOConfig
    usage = USAGE
    rows = "prompts"
    unit = "completions"
    per_token_logps = True
    sequence_parallel = True  # the training forward: generation stays unsplit, each rank sampling its own rows

    def check(self, cfg: GRPOConfig) -> None:
        self.check_existing_model(cfg, "configs/demo-grpo.yaml")
        load_tools(cfg.grpo.tools)  # a file that does not import, a function without type hints: exit 2 here
        check(cfg.grpo, len(Environments(cfg.grpo.environment).reward_funcs()))
        check_batch(cfg, distributed.world_size_from_env())  # before any process group: torchrun's WORLD_SIZE
        check_engine(cfg.rollout, distributed.device_kind(cfg.distributed) == "cuda")
        # A missing module, file or function, a reward-model directory that is not one (a causal LM): exit 2 here
        rewards.load_all(cfg.grpo.reward_funcs, trust_remote_code=cfg.model.trust_remote_code)
        rewards.reward_timeout(cfg.grpo.reward_timeout_s, cfg.distributed.timeout_s)

    def source_state(self, cfg: GRPOConfig) -> str | None:
        return "grpo_generation" if cfg.grpo.num_iterations > 1 else None

    def source(self, run) -> tuple[data.Built, Rollouts]:
        g, cfg = run.cfg.grpo, run.cfg
        built = build_data(run, self.unit)
        environments = Environments(g.environment)
        funcs = (rewards.load_all(g.reward_funcs, trust_remote_code=cfg.model.trust_remote_code)
                 + environments.reward_funcs())
        ref = reference(run) if g.beta else None
        models = {j: ModelReward(*reward_model(run, f.spec), cfg.train.micro_batch_size, run.env.device)
                  for j, f in enumerate(funcs) if f.fn is None}
        rollout = build_rollout(cfg.rollout, run, cfg.data.seq_len + g.max_completion_length,
                                cfg.train.micro_batch_size * cfg.train.grad_accum_steps)
        # Every rank samples micro_batch_size x grad_accum_steps completions, a sequence group's ranks each their own
        # (run.global_batch counts a group's rows once: the data-parallel ranks')
        prompts = run.global_batch * run.env.sp_size // g.num_generations
        run.metrics.info(f"grpo: {prompts} prompts x {g.num_generations} completions "
                         f"per step, loss {g.loss_type}, beta {g.beta:g}"
                         f"{f' (reference: {ref.kind})' if ref else ''}, "
                         f"{g.num_iterations} update(s) per generation batch, rewards "
                         f"{', '.join(f.spec for f in funcs)}, EOS ids {rollout.eos_ids}")
        for j, model in models.items():
            run.metrics.info(f"grpo: reward model {funcs[j].spec} ({model.model.describe()})")
        # Every rank gets the step's whole batch of prompts (global batch / G) and samples its share of completions.
        steps = data.make_steps(built, prompts, 1, 1, 0, cfg.train.seed, run.env.device, run.state.data)
        scorer = Scorer(funcs, g.reward_weights, g.num_generations, g.scale_rewards,
                        rewards.reward_timeout(g.reward_timeout_s, cfg.distributed.timeout_s), run.env.rank,
                        run.env.device, models)
        tool_use = None
        if g.tools or environments:
            parser = CallParser(g.tool_call_format, run.tokenizer, rollout.eos_ids)
            agent = Agent(run.tokenizer, parser, rollout.eos_ids, rollout.pad_id, g.max_tool_calling_iterations,
                          g.tool_timeout_s, g.max_concurrent_tool_calls, run.env.device)
            tool_use = ToolUse(agent, load_tools(g.tools), environments, cfg.data.seq_len)
        return built, Rollouts(run, PromptSteps(steps, g.num_iterations, run.state.data), rollout, scorer, ref,
                               tool_use)

    def setup(self, run, built) -> None:
        super().setup(run, built)
        self.objective = PolicyObjective(run.cfg.grpo, run.token_loss)
