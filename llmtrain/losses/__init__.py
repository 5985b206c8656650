"""Losses, one module each: token (token-weighted cross-entropy, full / chunked / liger; per-token
log-probs), preference (DPO, IPO, SimPO), policy (the GRPO family) and distill (chunked logit KD). A new
loss goes here; a recipe picks it."""
