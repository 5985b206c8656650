"""Rollouts: completions sampled from the policy for on-policy recipes (GRPO). engine: the seam and the engines
(local: the keyed sampler inside the training processes, under any parallel strategy; transformers: continuous
batching on each rank's own copy of the weights); vllm: vLLM colocated on each rank's own copy (CUDA, vllm
imported when built); vllm_server: a vLLM server on GPUs of its own (HTTP, weights over NCCL); vllm_worker: the
worker extension such a server runs for the weight-sync check; registry: grpo.engine's choices; sync: the
weight-sync check of an engine's copy."""
