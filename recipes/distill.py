#!/usr/bin/env python
"""Knowledge distillation (logit KD: forward / reverse KL, generalized JSD) of a causal LM student on a teacher,
with DDP, FSDP or FSDP2, on GPUs (NCCL) or CPU (gloo).

    torchrun --nproc_per_node=N recipes/distill.py --config configs/demo-distill.yaml [key.sub=value ...]
    python recipes/distill.py --help-config                     # every key (finetune's plus distill.*)

The recipe is llmtrain.recipes.distill.Distill (llmtrain/recipes/distill/); this script only runs it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout, installed or not

from llmtrain import distributed
from llmtrain.recipes.distill import Distill

if __name__ == "__main__":
    distributed.hard_exit(Distill().main())
