"""The GRPO runs' shared set-up (tests/grpo/test_grpo_recipe.py, test_grpo_engine_runs.py, test_keyed_dropout.py): a
tiny Llama on data/demo/prompts.jsonl, 3 prompts x 4 completions a step, and reward functions in a file."""

from __future__ import annotations

from pathlib import Path

from helpers import REPO

GRPO = REPO / "recipes" / "grpo.py"
CONFIG = """\
model:
  config: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
           num_key_value_heads: 2, max_position_embeddings: 64, tie_word_embeddings: true}
tokenizer: {path: assets/tokenizer}
data: {path: data/demo/prompts.jsonl, format: prompt, seq_len: 32}
parallel: {strategy: none}
train: {max_steps: 5, micro_batch_size: 6, grad_accum_steps: 2, lr: 3.0e-3, warmup_steps: 1, seed: 7,
        lr_schedule: constant}  # a run cut at step 3 decays its lr as the whole one does
grpo: {num_generations: 4, max_completion_length: 12, beta: 0.04, num_iterations: 2, reward_funcs: [REWARD]}
log: {every_steps: 1, progress: false, completions_every_steps: 1}
"""
REWARDS = """\
def chars(prompts, completions, completion_ids, **kw):
    return [len(c.strip()) / 10 for c in completions]
def fails(prompts, completions, completion_ids, answer, **kw):
    return [1 / (len(a) - len(a)) for a in answer]
def short(prompts, completions, completion_ids, **kw):
    return [0.0]
def nan_one(prompts, completions, completion_ids, **kw):
    return [float("nan") if i == 1 else 0.0 for i in range(len(completions))]
def never(prompts, completions, completion_ids, **kw):
    return [None] * len(completions)
def hangs(prompts, completions, completion_ids, **kw):
    import os, time
    if os.environ["RANK"] == "1":
        time.sleep(600)
    return [0.0] * len(completions)
def hangs_unstoppably(prompts, completions, completion_ids, **kw):
    import os, signal, time
    if os.environ["RANK"] == "1":  # ignores grpo.reward_timeout_s's alarm: the collective's timeout ends it,
        signal.signal(signal.SIGALRM, signal.SIG_IGN)  # then torchrun's SIGTERM kills it (not a step later)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(600)
    return [0.0] * len(completions)
"""


def write_config(tmp: Path, reward: str = "chars") -> Path:
    """tmp/rewards.py (REWARDS) and tmp/grpo.yaml (CONFIG) scored by rewards.py's `reward`."""
    (tmp / "rewards.py").write_text(REWARDS)
    config = tmp / "grpo.yaml"
    config.write_text(CONFIG.replace("REWARD", f"{tmp / 'rewards.py'}:{reward}"))
    return config
