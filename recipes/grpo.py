#!/usr/bin/env python
"""Online RL with verifiable rewards (GRPO, DAPO, Dr. GRPO) of a causal LM with DDP, FSDP or FSDP2, on GPUs
(NCCL) or CPU (gloo).

    torchrun --nproc_per_node=N recipes/grpo.py --config configs/demo-grpo.yaml [key.sub=value ...]

The recipe is llmtrain.recipes.grpo.GRPO (llmtrain/recipes/grpo.py); this script only runs it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout, installed or not

from llmtrain import distributed
from llmtrain.recipes.grpo import GRPO

if __name__ == "__main__":
    distributed.hard_exit(GRPO().main())
