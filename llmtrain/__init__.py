"""llmtrain: fine-tuning recipes for Llama-style models on PyTorch DDP / FSDP / FSDP2 (docs/architecture.md)."""

import logging

# transformers imports torchao whenever it is installed (llmtrain[qlora]); torchao then logs, on every import,
# that its CUDA-only kernels do not load and that torch deprecates its pytree registrations. Neither is
# anything a user can act on, and they would stand before a config error's one line.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
