"""llmtrain's GRPO-family loss and metrics against TRL's own GRPOTrainer._compute_loss, on identical inputs.

TRL is a dev-only comparison, kept out of llmtrain's environment; run this with a Python that has trl
installed (TRL 1.16.0 was checked), from the repo root:

    PYTHONPATH=. /path/to/trl-venv/bin/python tests/scripts/trl_grpo_parity.py

(e.g. a venv whose site-packages has a .pth line naming llmtrain's venv's site-packages, plus
pip install --no-deps trl==1.16.0: the same torch and transformers on both sides.) GRPOConfig is made with
bf16=False: TRL 1.16 defaults to bf16, which autocasts its fused LM head even on CPU (~1e-3 off in log-probs).

Both sides get the same tiny Llama weights, the same prompts and sampled completions (random ids with
EOS-ended and truncated rows, right-padded, prompts of one length: TRL's forward takes positions from
the layout, not the mask), the same advantages, sampling-time log-probs (num_iterations 2) or none
(num_iterations 1) and reference log-probs (beta > 0). TRL computes the policy's log-probs with its fused
LM head (logits / temperature) and its loss and metrics; llmtrain with TokenLoss.token_logps (chunked,
temperature) and llmtrain.losses.policy. Prints, per loss_type x beta x num_iterations, the loss and the
largest |difference| over the loss, the per-token log-probs, the metrics (kl, clip_ratio/low_mean,
high_mean, region_mean, low_min, high_max) and every parameter's gradient; exits non-zero above 1e-5.
(The advantages come in as inputs: their formula is checked against numpy in tests/grpo/test_grpo_loss.py.)"""

from __future__ import annotations

import sys
import tempfile

import torch
from datasets import Dataset
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from trl import GRPOConfig, GRPOTrainer

from llmtrain.data.formats import IGNORE
from llmtrain.losses import policy
from llmtrain.losses.token import TokenLoss, next_token_targets

ROWS, PROMPT, MAX_LEN, VOCAB = 8, 6, 10, 512
EPS, EPS_HIGH, TEMPERATURE = 0.2, 0.28, 0.7
REPO_TOKENIZER = "assets/tokenizer"


def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))


def batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, VOCAB, (ROWS, PROMPT), generator=g)
    completion_ids = torch.randint(3, VOCAB, (ROWS, MAX_LEN), generator=g)
    lengths = torch.tensor([10, 3, 7, 1, 10, 5, 8, 2])  # the 10s: truncated
    completion_mask = (torch.arange(MAX_LEN)[None] < lengths[:, None]).long()
    completion_ids = completion_ids.masked_fill(completion_mask == 0, 0)
    mask = completion_mask.bool()
    shift = lambda scale: ((torch.rand(ROWS, MAX_LEN, generator=g) - 0.5) * scale).masked_fill(~mask, 0)  # noqa: E731
    return {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": torch.randn(ROWS, generator=g),
            "shift_old": shift(0.8), "shift_ref": shift(0.6), "num_items_in_batch": completion_mask.sum()}


def ours(b: dict, old: torch.Tensor | None, ref: torch.Tensor | None, loss_type: str, beta: float):
    """llmtrain's side: rows prompt + completion, right-padded; labels IGNORE outside the completion."""
    model = tiny().train()
    ids = torch.cat([b["prompt_ids"], b["completion_ids"]], 1)
    labels = ids.masked_fill(torch.cat([torch.zeros_like(b["prompt_mask"]), b["completion_mask"]], 1) == 0, IGNORE)
    labels[:, :PROMPT] = IGNORE
    inputs = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(ids.shape[1]).expand(ROWS, -1)}
    keep = next_token_targets(labels) != IGNORE
    flat = TokenLoss("chunked", model, torch.device("cpu"), chunk_tokens=16).token_logps(model, inputs, TEMPERATURE)
    grid = lambda t: None if t is None else policy.to_grid(t[b["completion_mask"].bool()], keep)  # noqa: E731
    sums = policy.policy_sums(policy.to_grid(flat, keep), keep, b["advantages"], grid(old), grid(ref), loss_type,
                              EPS, EPS_HIGH, beta)
    totals = policy.policy_counts(keep)
    loss = policy.objective(sums, totals, loss_type, MAX_LEN)
    loss.backward()
    return loss.item(), policy.metrics(sums.metrics, sums.minima, int(totals[1]), beta), flat.detach(), grads(model)


def theirs(b: dict, old: torch.Tensor | None, ref: torch.Tensor | None, loss_type: str, beta: float, tok):
    def reward(prompts, completions, **kwargs):
        return [0.0] * len(prompts)

    with tempfile.TemporaryDirectory() as out:
        # beta 0 at construction: a positive one makes TRL load a reference model from the hub by name; the
        # reference log-probs come in the inputs instead, and _compute_loss reads self.beta.
        args = GRPOConfig(output_dir=out, loss_type=loss_type, beta=0.0, epsilon=EPS, epsilon_high=EPS_HIGH,
                          temperature=TEMPERATURE, num_generations=2, max_completion_length=MAX_LEN,
                          per_device_train_batch_size=ROWS, report_to="none", use_cpu=True,
                          bf16=False)  # TRL 1.16 defaults to bf16, which autocasts its LM head on CPU too
        trainer = GRPOTrainer(model=tiny(), reward_funcs=reward, args=args, processing_class=tok,
                              train_dataset=Dataset.from_list([{"prompt": "hi"}] * ROWS))
        trainer.model.train()
        trainer.beta = beta
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop, which is not run here
        inputs = {k: b[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                                    "num_items_in_batch")}
        if old is not None:
            inputs["old_per_token_logps"] = old
        if ref is not None:
            inputs["ref_per_token_logps"] = ref
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        loss = loss.item()
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k in policy.METRICS + policy.EXTREMES}
        # TRL's own per-token log-probs, for the log-prob comparison
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, torch.cat([b["prompt_ids"], b["completion_ids"]], 1),
                torch.cat([b["prompt_mask"], b["completion_mask"]], 1), MAX_LEN)
    return loss, metrics, logps, grads(trainer.model)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def main() -> int:
    tok = AutoTokenizer.from_pretrained(REPO_TOKENIZER)
    b = batch()
    mask = b["completion_mask"].bool()
    worst = 0.0
    # The sampling-time and reference log-probs: TRL's policy log-probs shifted by fixed amounts (ratios on
    # both sides of the clip range; a KL away from 0).
    _, _, base, _ = theirs(b, None, None, "grpo", 0.0, tok)
    for loss_type in policy.LOSS_TYPES:
        for beta in (0.0, 0.04):
            for iterations in (1, 2):
                old = (base + b["shift_old"]).masked_fill(~mask, 0) if iterations == 2 else None
                ref = (base + b["shift_ref"]).masked_fill(~mask, 0) if beta else None
                mine, mine_metrics, flat, mine_grads = ours(b, old, ref, loss_type, beta)
                trl, trl_metrics, trl_logps, trl_grads = theirs(b, old, ref, loss_type, beta, tok)
                assert mine_grads.keys() == trl_grads.keys()
                assert mine_metrics.keys() == trl_metrics.keys(), (mine_metrics.keys(), trl_metrics.keys())
                d = max([abs(mine - trl), (flat - trl_logps[mask]).abs().max().item()]
                        + [abs(mine_metrics[k] - trl_metrics[k]) for k in mine_metrics]
                        + [(mine_grads[k] - trl_grads[k]).abs().max().item() for k in mine_grads])
                print(f"{loss_type:8s} beta {beta:<5g} num_iterations {iterations}  loss {mine:+.6f} "
                      f"(TRL {trl:+.6f})  max |d| over loss, log-probs, {len(mine_metrics)} metrics, gradients {d:.2e}")
                worst = max(worst, d)
    print(f"worst {worst:.2e}")
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
