"""Online RL with verifiable rewards (recipes/grpo.py): GRPO, DAPO, Dr. GRPO.

What is this recipe's own (docs/grpo.md): the grpo: section; its batch source, Rollouts: the step's prompts
(data.format: prompt; every rank gets all of them, the same for grpo.num_iterations steps) -> an engine's
completions (llmtrain.rollout, grpo.engine; local keys them by (seed, generation batch, prompt, generation index))
-> rewards (llmtrain.rewards) -> group-relative advantages over every rank's rewards -> training rows; and its
objective, the clipped surrogate (llmtrain.losses.policy), num_iterations times on the same completions. With
num_iterations > 1 the generation batch is the source's checkpointed state, so a resume in its middle
continues on the same completions and sampling-time log-probs. The rest is the shared body's
(llmtrain/recipes/base.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch.distributed import ReduceOp

from llmtrain import data, distributed, rewards
from llmtrain.config import Config, ConfigError, ranged
from llmtrain.data import IGNORE, SAMPLE_INDEX
from llmtrain.losses import policy
from llmtrain.losses.token import next_token_targets
from llmtrain.models import hf as model_lib
from llmtrain.recipes.base import Recipe
from llmtrain.rollout import sync
from llmtrain.rollout.engine import Engine, EngineSetup, VLLMServer, completion_metrics
from llmtrain.rollout.local import Sampling
from llmtrain.rollout.registry import ENGINES, check_engine
from llmtrain.rollout.rows import micro_batches
from llmtrain.train.build import Run, build_data, sampling_weights
from llmtrain.train.frozen import FrozenModel, reference
from llmtrain.train.source import Batch
from llmtrain.train.step import Share
from llmtrain.utils import DTYPES

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
generated_tokens_per_s, and the drift guard's sampling/logprob_diff/mean, /max, sampling/importance_ratio/min,
/mean, /max (grpo.importance_correction); log.completions_every_steps: sampled completions to
output_dir/completions.jsonl.
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
    engine: Literal["local", "transformers", "vllm"] = "local"
    """What samples the completions: local (llmtrain.rollout.local's keyed sampler on the training model, the
    same completions at any world size, strategy or resume); transformers (transformers' continuous batching on
    each rank's own fp32 copy of the policy, its weights pushed and fingerprint-checked at every generation
    batch; reproducible for the same rows, not at another world size or split); vllm (vLLM colocated in each
    training process on CUDA, its own copy in the compute dtype, pushed and checked the same way, or on the
    server grpo.vllm_server_url names; needs `pip install vllm`, not tested on a GPU yet: docs/grpo.md)."""
    vllm_gpu_memory_utilization: float = ranged("(0, 1]", default=0.3)
    """grpo.engine=vllm: the fraction of the GPU's memory vLLM takes for its weights, activations and KV cache
    (TRL's vllm_gpu_memory_utilization); the training's model, gradients and optimizer need the rest."""
    vllm_enable_sleep_mode: bool = False
    """grpo.engine=vllm: vLLM sleeps between generations (weights offloaded to the CPU, KV cache freed), so
    training gets its memory back; costs a copy back before each push (TRL's vllm_enable_sleep_mode)."""
    vllm_server_url: str | None = None
    """grpo.engine=vllm: the base URL (http://host:8000) of a vLLM server on GPUs of its own to generate on, rank 0
    pushing it the weights over NCCL (TRL's vllm_mode=server, vllm_server_base_url); started as docs/grpo.md shows.
    None: vLLM colocated in the training processes (grpo.vllm_gpu_memory_utilization and _enable_sleep_mode)."""
    vllm_server_timeout: float = ranged("(0, inf)", default=240.0)
    """grpo.vllm_server_url: seconds to wait for the server at start (until /health answers) and for each of its
    answers (TRL's vllm_server_timeout)."""
    vllm_group_port: int = ranged("[1, 65535]", default=51216)
    """grpo.vllm_server_url: the port on rank 0's host of the NCCL group that sends the weights to the server's
    workers (TRL's vllm_group_port)."""
    importance_correction: Literal["none", "tis", "mis"] = "none"
    """Correct for the engine's log-probs differing from the trainer's (TRL's vllm_importance_sampling_*): tis
    multiplies each token's policy-gradient loss by min(exp(trainer - engine log-prob), importance_cap)
    (truncated importance sampling), mis by that ratio where it is <= importance_cap and 0 beyond (masked);
    none logs the ratio (sampling/importance_ratio/*) only."""
    importance_cap: float = ranged("(0, inf)", default=2.0)
    """C of grpo.importance_correction: tis truncates the ratio at C, mis masks what exceeds C."""
    importance_level: Literal["token", "sequence"] = "token"
    """grpo.importance_correction's ratio per token, or per completion (exp of the sum of its tokens' log-prob
    differences, applied to all its tokens; TRL's sequence_* modes)."""
    reward_timeout_s: float | None = ranged("(0, inf)", default=None)
    """Seconds a reward function's call may take on a rank; beyond, the run stops (exit 1) with one line naming
    the function and the rank. Must be below distributed.timeout_s (None: half of it)."""


@dataclass
class GRPOConfig(Config):
    """recipes/grpo.py's Config: the shared sections plus grpo:."""
    grpo: GRPOSection = field(default_factory=GRPOSection)


def check(section: GRPOSection) -> None:
    """Set-up checks across grpo.* keys (each key's own range and choices are load_config's: GRPOSection's
    ranged and Literal fields)."""
    if not section.reward_funcs:
        raise ConfigError("grpo.reward_funcs: name at least one reward function, e.g. [llmtrain.rewards:exact_answer]")
    if section.reward_weights and len(section.reward_weights) != len(section.reward_funcs):
        raise ConfigError(f"grpo.reward_weights: {len(section.reward_weights)} weights for "
                          f"{len(section.reward_funcs)} grpo.reward_funcs; give one per function")


def check_batch(cfg: GRPOConfig, world_size: int) -> None:
    """A step's completions (micro x accumulation x ranks) are whole groups of grpo.num_generations."""
    completions = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * world_size
    if completions % cfg.grpo.num_generations:
        raise ConfigError(f"train.micro_batch_size x train.grad_accum_steps x {world_size} ranks = {completions} "
                          f"completions per step must be a multiple of grpo.num_generations = "
                          f"{cfg.grpo.num_generations}")


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


def keep(batch: dict) -> torch.Tensor:
    """The trained tokens of a micro-batch of training rows (a completion's, up to and including its EOS)."""
    return next_token_targets(batch["labels"]) != IGNORE


class PolicyObjective:
    """The clipped surrogate as sums over a micro-batch's completions / the step's completions and tokens."""

    def __init__(self, section: GRPOSection, token_loss):
        self.section, self.token_loss = section, token_loss
        self.drift_minima = None  # the step's PolicySums.drift_minima so far, combined by share(), used by report()

    def counts(self, batch: dict) -> torch.Tensor:
        return policy.policy_counts(keep(batch))

    def share(self, model, batch: dict, totals: torch.Tensor) -> Share:
        g, trained = self.section, keep(batch)
        logps = policy.to_grid(self.token_loss.token_logps(model, batch, g.temperature), trained)
        sums = policy.policy_sums(logps, trained, batch["advantages"], batch.get("old_logps"),
                                  batch.get("ref_logps"), g.loss_type, g.epsilon, g.epsilon_high, g.beta,
                                  g.use_bias_correction_kl, batch["engine_logps"], g.importance_correction,
                                  g.importance_cap, g.importance_level)
        part = policy.objective(sums, totals[1:], g.loss_type, g.max_completion_length)
        self.drift_minima = sums.drift_minima if self.drift_minima is None else torch.minimum(self.drift_minima,
                                                                                              sums.drift_minima)
        return Share(part, torch.cat([part.detach().reshape(1), sums.metrics, sums.drift]))

    def report(self, metrics: torch.Tensor, totals: torch.Tensor) -> tuple[float, dict]:
        n = 1 + len(policy.METRICS)
        minima = distributed.all_reduce(self.drift_minima, ReduceOp.MIN)  # every rank reports: a collective
        self.drift_minima = None
        return metrics[0].item(), {**policy.metrics(metrics[1:n], None, int(totals[2]), self.section.beta),
                                   **policy.drift_metrics(metrics[n:], minima)}


class Rollouts:
    """GRPO's batch source: per generation batch, this rank's completions of the step's prompts from the engine,
    rewards, group-relative advantages over every rank's rewards, and the training rows (with the sampling-time
    log-probs when num_iterations > 1, the reference's when beta > 0), reused num_iterations times. Its state
    (num_iterations > 1) is the generation batch, every rank's, JSON-able: completion token ids, truncation,
    advantages, the trainer's sampling-time, the engine's and the reference's log-probs of the trained tokens,
    the batch's metrics."""

    def __init__(self, run: Run, prompts: PromptSteps, engine: Engine, sampling: Sampling, funcs: list,
                 ref: FrozenModel | None, pad: int):
        self.run, self.section, self.prompts, self.engine = run, run.cfg.grpo, prompts, engine
        self.sampling, self.funcs, self.ref, self.pad = sampling, funcs, ref, pad
        self.reward_timeout = rewards.reward_timeout(self.section.reward_timeout_s, run.cfg.distributed.timeout_s)
        self.held: dict = {}
        self.micro, self.metrics = None, {}

    # -- BatchSource ------------------------------------------------------------------------------
    def next(self) -> Batch:
        prompts, index = next(self.prompts)[0], self.run.state.step // self.section.num_iterations
        t0 = time.perf_counter()
        if self.micro is None or self.held.get("step") != index:
            restored = self.held.get("step") == index
            self.micro, self.metrics = self.restore(prompts) if restored else self.generate(prompts, index)
        return Batch(self.micro, self.metrics, time.perf_counter() - t0)

    def position(self) -> dict:
        return self.prompts.position()

    def state_dict(self) -> dict:
        return self.held

    def load_state_dict(self, state: dict) -> None:
        self.held = state

    # -- a generation batch -----------------------------------------------------------------------
    def mine(self) -> range:
        """This rank's completions in the step's global order (prompt-major: prompt c // G, generation c % G)."""
        per_rank = self.run.cfg.train.micro_batch_size * self.run.cfg.train.grad_accum_steps
        return range(self.run.env.rank * per_rank, (self.run.env.rank + 1) * per_rank)

    def generate(self, prompts: dict, index: int) -> tuple[list[dict], dict]:
        run, g, env = self.run, self.section, self.run.env
        G, rows = g.num_generations, self.mine()
        self.push()
        prompt_index = [int(prompts["prompt_index"][c // G]) for c in rows]
        out = self.engine.generate([prompts["prompt_ids"][c // G] for c in rows],
                                   [(run.cfg.train.seed, index, p, c % G) for p, c in zip(prompt_index, rows)],
                                   self.sampling)
        texts = run.tokenizer.batch_decode(out.tokens, skip_special_tokens=True)
        chat = [isinstance(prompts["prompts"][c // G], list) for c in rows]
        completions = [[{"role": "assistant", "content": t}] if is_chat else t for t, is_chat in zip(texts, chat)]
        columns = [prompts["columns"][c // G] for c in rows]
        names = sorted({k for c in columns for k in c})
        per_func = self.score([prompts["prompts"][c // G] for c in rows], completions, out.tokens,
                              {k: [c.get(k) for c in columns] for k in names}, prompt_index)
        scores = distributed.gather_rows(per_func.to(env.device)).cpu()
        adv = policy.group_advantages(scores, g.reward_weights, G, g.scale_rewards)
        if note := rewards.none_applied(scores, self.funcs, prompts["prompt_index"].tolist(), run.state.step + 1):
            run.metrics.info(note)
        metrics = {**policy.reward_metrics(scores, [f.name for f in self.funcs], adv),
                   **completion_metrics(out, env.device)}
        micro = self.batches(prompts, out.tokens, out.truncated, adv.advantages[rows.start:rows.stop].tolist(),
                             out.logps)
        old = self.set_logps(micro, "old_logps", self.trainer_logps(micro)) if g.num_iterations > 1 else None
        ref = self.set_logps(micro, "ref_logps", self.reference_logps(micro)) if self.ref else None
        every_n = run.cfg.log.completions_every_steps
        if every_n and index % every_n == 0:
            self.log_completions(rows, prompt_index, prompts, texts, out.tokens, out.truncated, per_func, adv,
                                 run.state.step + 1)
        if g.num_iterations > 1:  # every rank's part, for a checkpoint in the middle of the batch
            parts = distributed.gather_objects((out.tokens, out.truncated, old, ref, out.logps))
            self.held = {"step": index, "advantages": adv.advantages.tolist(), "metrics": metrics,
                         **{k: sum((p[i] for p in parts), []) if parts[0][i] is not None else None
                            for i, k in enumerate(("completions", "truncated", "old", "ref", "engine"))}}
        return micro, metrics

    def push(self) -> None:
        """The policy after this many updates into the engine; one that samples from its own copy gets the full
        weights (LoRA merged) and is checked against them (llmtrain.rollout.sync: one line, exit 1, if stale)."""
        run, step, copies = self.run, self.run.state.step, self.engine.copies_weights
        full = sampling_weights(run) if copies else {}
        self.engine.update_weights(step, full)
        if copies:
            trainer = sync.trainer_fingerprint(full, run.cfg.train.seed, step, self.engine.weights_dtype)
            sync.check(trainer, self.engine.fingerprint(list(trainer)), step, self.section.engine)

    def restore(self, prompts: dict) -> tuple[list[dict], dict]:
        """A resume in the middle of a generation batch: this rank's micro-batches from the checkpoint's."""
        held, rows = {"engine": self.held["old"], **self.held}, self.mine()  # saved before the drift guard: none
        part = {k: held[k][rows.start:rows.stop] if held[k] is not None else None
                for k in ("completions", "truncated", "advantages", "old", "ref", "engine")}
        micro = self.batches(prompts, part["completions"], part["truncated"], part["advantages"], part["engine"])
        n = self.run.cfg.train.micro_batch_size
        for i, b in enumerate(micro):
            for key, name in (("old", "old_logps"), ("ref", "ref_logps")):
                if part[key] is not None:
                    flat = torch.tensor(sum(part[key][i * n:(i + 1) * n], []), device=b["labels"].device)
                    b[name] = policy.to_grid(flat, keep(b))
        return micro, held["metrics"]

    def score(self, prompts, completions, tokens, columns, prompt_index) -> torch.Tensor:
        """[completions, functions] rewards; a failure on any rank stops every rank (rewards.score_everywhere)."""
        per_func = rewards.score_everywhere(self.funcs, prompts, completions, tokens, columns, prompt_index,
                                            self.reward_timeout, self.run.env.rank)
        return torch.tensor(per_func, dtype=torch.float64)

    def batches(self, prompts: dict, tokens: list[list[int]], truncated: list[bool], advantages: list[float],
                engine: list[list[float]]) -> list[dict]:
        """This rank's micro-batches of training rows (prompt + completion) with their advantages and the engine's
        log-probs of the trained tokens (engine_logps; a completion left out of the loss,
        grpo.mask_truncated_completions, has none)."""
        g, n, rows, device = self.section, self.run.cfg.train.micro_batch_size, self.mine(), self.run.env.device
        ids = [prompts["prompt_ids"][c // g.num_generations] for c in rows]
        micro = micro_batches(ids, tokens, truncated, self.pad, n, g.mask_truncated_completions, device)
        for i, b in enumerate(micro):
            part = slice(i * n, (i + 1) * n)
            trained = [x for row, cut in zip(engine[part], truncated[part])
                       if not (cut and g.mask_truncated_completions) for x in row]
            b.update(advantages=torch.tensor(advantages[part], device=device),
                     engine_logps=policy.to_grid(torch.tensor(trained, device=device), keep(b)))
            b[SAMPLE_INDEX] = torch.tensor(rows[part], device=device)  # keys its dropout
        return micro

    def trainer_logps(self, micro: list[dict]) -> list[torch.Tensor]:
        """The policy's log-probs of each micro-batch's trained tokens at sampling time, flat (num_iterations > 1:
        the ratio's denominator; the loss's own computation, so that the first update's ratio is exactly 1)."""
        run, t = self.run, self.section.temperature
        with torch.no_grad(), run.autocast():
            return [run.token_loss.token_logps(run.model, b, t) for b in micro]

    def reference_logps(self, micro: list[dict]) -> list[torch.Tensor]:
        """The reference's log-probs of each micro-batch's trained tokens, flat (beta > 0: the KL term)."""
        t = self.section.temperature
        return [self.ref.forward(lambda model, token_loss: token_loss.token_logps(model, b, t)) for b in micro]

    @staticmethod
    def set_logps(micro: list[dict], name: str, flats: list[torch.Tensor]) -> list[list[float]]:
        """Each micro-batch's flat log-probs as its [rows, tokens] grid under `name`; -> per completion lists
        (the generation batch's state)."""
        out = []
        for b, flat in zip(micro, flats):
            b[name] = policy.to_grid(flat, keep(b))
            out += [row[k].tolist() for row, k in zip(b[name], keep(b))]
        return out

    def log_completions(self, rows, prompt_index, prompts, texts, tokens, truncated, per_func, adv, step) -> None:
        """The first LOGGED_PROMPTS prompts' completions, their rewards and advantages -> completions.jsonl."""
        G, names = self.section.num_generations, [f.name for f in self.funcs]
        records = [{"step": step, "prompt_index": p, "generation": c % G, "prompt": prompts["prompts"][c // G],
                    "completion": text, "tokens": len(ids), "truncated": cut,
                    "rewards": {n: None if v != v else v for n, v in zip(names, scores.tolist())},
                    "reward": float(adv.rewards[c]), "advantage": float(adv.advantages[c])}
                   for c, p, text, ids, cut, scores in zip(rows, prompt_index, texts, tokens, truncated, per_func)
                   if c // G < LOGGED_PROMPTS]
        parts = distributed.gather_objects(records)
        if self.run.env.is_main:
            with open(Path(self.run.cfg.output_dir) / "completions.jsonl", "a") as f:
                f.writelines(json.dumps(r) + "\n" for part in parts for r in part)


class GRPO(Recipe):
    name = "grpo"
    config_cls = GRPOConfig
    usage = USAGE
    rows = "prompts"
    unit = "completions"

    def check(self, cfg: GRPOConfig) -> None:
        self.check_existing_model(cfg, "configs/demo-grpo.yaml")
        check(cfg.grpo)
        check_batch(cfg, distributed.world_size_from_env())  # before any process group: torchrun's WORLD_SIZE
        device = cfg.distributed.device
        check_engine(cfg.grpo.engine, device == "cuda" or (device == "auto" and torch.cuda.is_available()),
                     cfg.grpo.vllm_server_url)
        rewards.load_all(cfg.grpo.reward_funcs)  # a missing module, file or function: exit 2 here
        rewards.reward_timeout(cfg.grpo.reward_timeout_s, cfg.distributed.timeout_s)
        if cfg.train.loss_impl == "liger":
            raise ConfigError("train.loss_impl: recipes/grpo.py takes chunked (the default) or full; liger yields "
                              "no per-token log-probs")

    def source_state(self, cfg: GRPOConfig) -> str | None:
        return "grpo_generation" if cfg.grpo.num_iterations > 1 else None

    def source(self, run) -> tuple[data.Built, Rollouts]:
        g, tok, cfg = run.cfg.grpo, run.tokenizer, run.cfg
        built = build_data(run, self.unit)
        funcs = rewards.load_all(g.reward_funcs)
        eos = model_lib.stop_ids(run.model_config.eos_token_id, tok)
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
        ref = reference(run) if g.beta else None
        run.metrics.info(f"grpo: {run.global_batch // g.num_generations} prompts x {g.num_generations} completions "
                         f"per step, loss {g.loss_type}, beta {g.beta:g}"
                         f"{f' (reference: {ref.kind})' if ref else ''}, "
                         f"{g.num_iterations} update(s) per generation batch, rewards "
                         f"{', '.join(f.spec for f in funcs)}, EOS ids {eos}")
        # Every rank gets the step's whole batch of prompts (global batch / G) and samples its share of completions.
        steps = data.make_steps(built, run.global_batch // g.num_generations, 1, 1, 0, cfg.train.seed, run.env.device,
                                run.state.data)
        setup = EngineSetup(cfg.data.seq_len + g.max_completion_length,
                            cfg.train.micro_batch_size * cfg.train.grad_accum_steps, cfg.train.seed,
                            DTYPES[cfg.parallel.mixed_precision], cfg.output_dir, g.vllm_gpu_memory_utilization,
                            g.vllm_enable_sleep_mode,
                            None if g.vllm_server_url is None else VLLMServer(
                                g.vllm_server_url, g.vllm_server_timeout, g.vllm_group_port))
        engine = ENGINES[g.engine](run.model, run.model_config, run.autocast, eos, pad, run.env.device, setup)
        return built, Rollouts(run, PromptSteps(steps, g.num_iterations, run.state.data), engine,
                               Sampling(g.max_completion_length, g.temperature, g.top_p, g.top_k), funcs, ref, pad)

    def setup(self, run, built) -> None:
        super().setup(run, built)
        self.objective = PolicyObjective(run.cfg.grpo, run.token_loss)
