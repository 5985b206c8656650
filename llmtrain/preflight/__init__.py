"""`python -m llmtrain.preflight`, the documented command: the multi-node checks of llmtrain/run/preflight.py
(its __main__ runs them)."""
