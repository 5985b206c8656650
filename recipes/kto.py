#!/usr/bin/env python
"""KTO (Kahneman-Tversky Optimization) of a causal LM on unpaired thumbs-up / thumbs-down data, with DDP, FSDP or
FSDP2, on GPUs (NCCL) or CPU (gloo).

    torchrun --nproc_per_node=N recipes/kto.py --config configs/demo-kto.yaml [key.sub=value ...]
    python recipes/kto.py --help-config                        # every key (finetune's plus kto.*)

The recipe is llmtrain.recipes.kto.KTO (llmtrain/recipes/kto.py); this script only runs it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout, installed or not

from llmtrain import distributed
from llmtrain.recipes.kto import KTO

if __name__ == "__main__":
    distributed.hard_exit(KTO().main())
