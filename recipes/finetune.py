#!/usr/bin/env python
"""Fine-tune a Llama-style causal LM with DDP, FSDP (FSDP1) or FSDP2, on GPUs (NCCL) or CPU (gloo).

    torchrun --nproc_per_node=N recipes/finetune.py --config configs/demo.yaml [key.sub=value ...]
    python recipes/finetune.py --config configs/demo.yaml           # one process, same code path
    python recipes/finetune.py --help-config                        # every key, type, default

The recipe is llmtrain.recipes.sft.Finetune (llmtrain/recipes/sft.py); this script only runs it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout, installed or not

from llmtrain import distributed
from llmtrain.recipes.sft import Finetune

if __name__ == "__main__":
    distributed.hard_exit(Finetune().main())
