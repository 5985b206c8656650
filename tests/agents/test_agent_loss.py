"""Tool tokens carry no loss (in process): a multi-turn trajectory's training rows label only the model's tokens, the
policy loss's gradient reaches no logit that predicts a tool token, and a tool result's text changes the loss only
through the context the later turns see."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llmtrain.data.formats import IGNORE
from llmtrain.losses import policy
from llmtrain.losses.token import next_token_targets, token_logps
from llmtrain.rollout.rows import completion_mask, policy_rows

PROMPT = [1, 5, 6, 7]
#            turn 1       tool result        turn 2
TRAJ = [10, 11, 12, 2] + [20, 21, 22] + [13, 14, 2]
MASK = [1, 1, 1, 1] + [0, 0, 0] + [1, 1, 1]


def loss_and_grad(model, traj: list[int]):
    """The GRPO (dapo) loss of one trajectory with advantage 1 (the engine's log-probs: the trainer's), and its
    gradient with respect to the logits."""
    engine = [-0.5 if m else 0.0 for m in MASK]
    (b,) = policy_rows([PROMPT], [traj], [False], [1.0], [engine], range(1), 1, 0, False, torch.device("cpu"), [MASK])
    out = model(input_ids=b["input_ids"], position_ids=b["position_ids"])
    logits = out.logits.detach().requires_grad_()
    mask = completion_mask(b)
    logps = policy.to_grid(token_logps(logits, b["labels"]), mask)
    sums = policy.policy_sums(logps, mask, b["advantages"], None, None, "dapo", 0.2, None, 0.0,
                              engine_logps=b["engine_logps"])
    loss = policy.objective(sums, policy.policy_counts(mask), "dapo", 16)
    loss.backward()
    return b, loss.detach(), logits.grad[0], logps.detach()


def test_tool_tokens_carry_no_loss():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    b, loss, grad, logps = loss_and_grad(model, TRAJ)
    labels = b["labels"][0, len(PROMPT):].tolist()
    assert labels == [t if m else IGNORE for t, m in zip(TRAJ, MASK)]
    assert b["engine_logps"][completion_mask(b)].tolist() == [-0.5] * sum(MASK)  # the model's tokens' only
    targets = next_token_targets(b["labels"])[0]
    tool_positions = [len(PROMPT) - 1 + j for j, m in enumerate(MASK) if not m]  # the logits predicting tool tokens
    assert grad[tool_positions].abs().max() == 0
    assert all(grad[p].abs().max() > 0 for p in range(len(targets)) if targets[p] != IGNORE)
    assert completion_mask(b).sum() == sum(MASK)  # dapo's token count: the model's tokens
    # Another tool result: the first turn's log-probs are the same; the second turn's see another context.
    other = TRAJ[:4] + [23, 24, 25] + TRAJ[7:]
    _, loss2, grad2, logps2 = loss_and_grad(model, other)
    assert torch.equal(logps2[0, :len(PROMPT) + 3], logps[0, :len(PROMPT) + 3])
    second = slice(len(PROMPT) + 7, len(PROMPT) + 10)
    assert not torch.equal(logps2[0, second], logps[0, second]) and grad2[tool_positions].abs().max() == 0
    assert loss2 == loss == -1  # num_iterations 1: the ratio is 1 (its gradient is the policy gradient)
