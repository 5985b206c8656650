"""Scoring a generation batch (GRPO): this rank's completions scored by the reward functions (llmtrain.rewards) and
reward models (ModelReward), every rank's scores gathered, and the group-relative advantages over them
(llmtrain.losses.policy)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from llmtrain import distributed, rewards
from llmtrain.losses import policy


class Scores(NamedTuple):
    per_func: torch.Tensor          # [this rank's completions, functions] float64 (NaN: the function returned None)
    advantages: policy.Advantages   # the global batch's, in its order
    metrics: dict[str, float]       # TRL's reward metrics over the global batch
    note: str | None                # a line for the log when no function applied to any completion


class ModelReward:
    """A reward model of grpo.reward_funcs, scoring as TRL's GRPOTrainer does with one: each prompt + completion
    written with the reward model's own tokenizer (text: the two concatenated; messages: the whole conversation
    through its chat template), tokenized without added special tokens and padded on the right; the reward is the
    model's score at the last token that is not its pad (transformers' sequence classifier, the config's
    pad_token_id: the tokenizer's). model: a frozen model under the policy's strategy (llmtrain.train.frozen's
    FrozenModel: forward(fn) runs fn(model, _) under no_grad), so a call is collective: every rank scores as many
    completions, batch_size at a time."""

    def __init__(self, model, tokenizer, batch_size: int, device: torch.device):
        self.model, self.tokenizer, self.batch_size, self.device = model, tokenizer, batch_size, device

    def texts(self, prompts: list, completions: list) -> list[str]:
        return [self.tokenizer.apply_chat_template(p + c, tokenize=False) if isinstance(p, list) else p + c
                for p, c in zip(prompts, completions)]

    def __call__(self, prompts: list, completions: list) -> list[float]:
        texts = self.texts(prompts, completions)
        return [r for i in range(0, len(texts), self.batch_size) for r in self.scores(texts[i:i + self.batch_size])]

    def scores(self, texts: list[str]) -> list[float]:
        batch = self.tokenizer(texts, return_tensors="pt", padding=True, padding_side="right",
                               add_special_tokens=False).to(self.device)
        logits = self.model.forward(lambda model, _: model(input_ids=batch["input_ids"], use_cache=False,
                                                           attention_mask=batch["attention_mask"]).logits)
        return logits[:, 0].float().tolist()


class Scorer:
    """The reward functions and how their rewards become advantages: weights (one per function, [] for all 1),
    num_generations completions per prompt (a group), scale_rewards (group | batch | none), timeout_s per call;
    models: the reward models among funcs, by their index (ModelReward)."""

    def __init__(self, funcs: list[rewards.RewardFunc], weights: list[float], num_generations: int,
                 scale_rewards: str, timeout_s: float, rank: int, device: torch.device,
                 models: dict[int, ModelReward]):
        self.funcs, self.weights, self.G, self.scale = funcs, weights, num_generations, scale_rewards
        self.timeout_s, self.rank, self.device, self.models = timeout_s, rank, device, models

    def score(self, batch: dict, rows: range, tokens: list[list[int]], texts: list[str], step: int,
              trajectories: list[list[dict]] | None = None, extra: dict[str, list] | None = None) -> Scores:
        """Collective. batch: the step's prompts (every rank's: prompts, columns, prompt_index); rows: this rank's
        completions in the global order (completion c of prompt c // G); tokens, texts: theirs; step: the step
        they train (1-based, for the log); trajectories: multi-turn ones' messages (the completions the functions
        get, as in TRL); extra: more columns, one value per completion (TRL's `environments`)."""
        at = [c // self.G for c in rows]
        prompts = [batch["prompts"][i] for i in at]
        completions = trajectories or [[{"role": "assistant", "content": t}] if isinstance(p, list) else t
                                       for t, p in zip(texts, prompts)]
        columns = [batch["columns"][i] for i in at]
        names = sorted({k for c in columns for k in c})
        scored = {j: model(prompts, completions) for j, model in self.models.items()}  # collective: before user code
        per_func = torch.tensor(rewards.score_everywhere(
            self.funcs, prompts, completions, tokens, {k: [c.get(k) for c in columns] for k in names} | (extra or {}),
            [int(batch["prompt_index"][i]) for i in at], self.timeout_s, self.rank, scored), dtype=torch.float64)
        scores = distributed.gather_rows(per_func.to(self.device)).cpu()
        adv = policy.group_advantages(scores, self.weights, self.G, self.scale)
        note = rewards.none_applied(scores, self.funcs, batch["prompt_index"].tolist(), step)
        return Scores(per_func, adv, policy.reward_metrics(scores, [f.name for f in self.funcs], adv), note)
