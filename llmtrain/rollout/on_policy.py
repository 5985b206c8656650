"""On-policy distillation's batch source (GKD, distill.on_policy_fraction): on the steps on_policy() picks, each
data row's prompt completed by the student with the rollout: section's engine (llmtrain.rollout.registry.build),
and the same objective trains on those rows."""

from __future__ import annotations

import random
import time
from typing import Callable

import torch
from torch.distributed import ReduceOp

from llmtrain import data, distributed
from llmtrain.checkpoint import TrainState
from llmtrain.rollout.engine import Sampling
from llmtrain.rollout.local import sample_seed
from llmtrain.rollout.record import completion_metrics
from llmtrain.rollout.registry import Rollout
from llmtrain.rollout.rows import micro_batches
from llmtrain.train.source import Batch, BatchSource, DerivedSource


def on_policy(seed: int, step: int, fraction: float) -> bool:
    """Whether the step after `step` updates samples its rows' completions: a uniform drawn from (seed, step)
    alone below `fraction` (0 never, 1 always), so every rank agrees without a collective and a resume at any
    step, onto any world size, decides again what the uninterrupted run decided."""
    return random.Random(sample_seed(seed, step)).random() < fraction


def prompts_of(micro: list[dict]) -> list[list[int]]:
    """Each row of the micro-batches, in order, up to its first trained token (the whole row when it trains
    none: an example whose prompt data.seq_len cut)."""
    out = []
    for b in micro:
        trained = b["labels"] != data.IGNORE
        first = torch.where(trained.any(1), trained.int().argmax(1), trained.shape[1])
        out += [row[:n].tolist() for row, n in zip(b["input_ids"], first.tolist())]
    return out


class OnPolicySource(DerivedSource):
    """The data's micro-batches (a BatchSource) as they are on an off-policy step; on an on-policy step
    (on_policy(seed, step, fraction)), the student's weights pushed into the engine (rollout.weights; nothing for
    the local engine, which samples the training model under any strategy) and their rows' prompts completed by
    it, each keyed (seed, step, its sample's index in the step's global batch) so that the local engine's
    completion depends on neither the world size nor the accumulation split, and made into training rows
    (prompt + completion, the completion's tokens trained, its first EOS included: llmtrain.rollout.rows) in the
    same micro-batches of micro_batch_size. The sampling is the step's work (Batch.work_s); nothing is kept
    beyond the data's position, since a resumed run samples the same completions from the same weights. An engine
    with its own copy of the policy is drift-guarded: student_logps(micro), the student's log-probs of each
    micro-batch's trained tokens at the sampling temperature (flat; one no_grad forward), against the engine's
    (logprob_drift)."""

    def __init__(self, inner: BatchSource, rollout: Rollout, sampling: Sampling, fraction: float, seed: int,
                 state: TrainState, micro_batch_size: int, device: torch.device,
                 student_logps: Callable[[list[dict]], list[torch.Tensor]]):
        super().__init__(inner)
        self.rollout, self.sampling, self.fraction, self.seed = rollout, sampling, fraction, seed
        self.state, self.micro_batch_size, self.device = state, micro_batch_size, device
        self.student_logps = student_logps

    def next(self) -> Batch:
        step = self.state.step
        batch = self.inner.next()
        if not on_policy(self.seed, step, self.fraction):
            return batch._replace(metrics={**batch.metrics, "on_policy": 0})
        t0 = time.perf_counter()
        prompts = prompts_of(batch.micro)
        keys = [(self.seed, step, int(i)) for b in batch.micro for i in b[data.SAMPLE_INDEX]]
        self.rollout.weights.push(step)
        out = self.rollout.engine.generate(prompts, keys, self.sampling)
        micro = micro_batches(prompts, out.tokens, out.truncated, self.rollout.pad_id, self.micro_batch_size, False,
                              self.device)
        for rows, b in zip(micro, batch.micro):
            rows[data.SAMPLE_INDEX] = b[data.SAMPLE_INDEX]  # keys its dropout masks, as the data's rows
        metrics = {**batch.metrics, "on_policy": 1, **completion_metrics(out, self.device)}
        if self.rollout.engine.copies_weights:
            metrics.update(logprob_drift(self.student_logps(micro), out.logps, self.device))
        return Batch(micro, metrics, batch.work_s + time.perf_counter() - t0)


def logprob_drift(trainer: list[torch.Tensor], engine: list[list[float]], device: torch.device) -> dict[str, float]:
    """Collective: sampling/logprob_diff/mean and /max (GRPO's drift guard metrics) over every rank's sampled tokens:
    |the trainer's log-prob - the engine's| (trainer: flat per micro-batch, engine: per completion, the same tokens
    in the same order)."""
    diff = (torch.cat(trainer).float() - torch.tensor(sum(engine, []), device=device)).abs()
    sums = distributed.all_reduce(torch.stack([diff.sum(), torch.tensor(float(len(diff)), device=device)]))
    top = distributed.all_reduce(diff.max() if len(diff) else torch.zeros((), device=device), ReduceOp.MAX)
    return {"sampling/logprob_diff/mean": (sums[0] / sums[1].clamp(min=1)).item(),
            "sampling/logprob_diff/max": top.item()}
