"""Losses, one module each: token (token-weighted cross-entropy, full / chunked / liger; per-token
log-probs) and preference (DPO, IPO, SimPO). A new loss goes here; a recipe picks it."""
