"""Rollouts: completions sampled from the policy for on-policy recipes (GRPO). local: the keyed sampler inside
the training processes, under any parallel strategy."""
