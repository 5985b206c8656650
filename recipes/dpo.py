#!/usr/bin/env python
"""Preference tuning (DPO, IPO, SimPO) of a causal LM with DDP, FSDP or FSDP2, on GPUs (NCCL) or CPU (gloo).

    torchrun --nproc_per_node=N recipes/dpo.py --config configs/demo-dpo.yaml [key.sub=value ...]
    python recipes/dpo.py --help-config                        # every key (finetune's plus dpo.*)

The recipe is llmtrain.recipes.dpo.DPO (llmtrain/recipes/dpo.py); this script only runs it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout, installed or not

from llmtrain import distributed
from llmtrain.recipes.dpo import DPO

if __name__ == "__main__":
    distributed.hard_exit(DPO().main())
