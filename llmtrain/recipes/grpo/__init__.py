"""Online RL with verifiable rewards (recipes/grpo.py): GRPO, DAPO, Dr. GRPO.

What is this recipe's own (docs/grpo.md): the grpo: section; its batch source, Rollouts: the step's prompts
(data.format: prompt; every rank gets all of them, the same for grpo.num_iterations steps) -> an engine's
completions (the rollout: section's engine, llmtrain.rollout.registry.build, its weights pushed by
llmtrain.rollout.sync; local keys them by (seed, generation batch, prompt, generation index)) -> rewards and
group-relative advantages over every rank's rewards (llmtrain.rollout.scoring) -> training rows with their
log-probs (llmtrain.rollout.rows) and the completions.jsonl record (llmtrain.rollout.record); and its objective,
the clipped surrogate (llmtrain.losses.policy), num_iterations times on the same completions. With
num_iterations > 1 the generation batch is the source's checkpointed state (rows.GenerationBatch), so a resume in
its middle continues on the same completions and sampling-time log-probs. The rest is the shared body's
(llmtrain/recipes/base.py).
"""

from llmtrain.recipes.grpo.config import GRPOConfig, GRPOSection
from llmtrain.recipes.grpo.recipe import GRPO

__all__ = ["GRPO", "GRPOConfig", "GRPOSection"]
