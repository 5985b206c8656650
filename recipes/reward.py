#!/usr/bin/env python
"""Reward-model training (Bradley-Terry, as TRL's RewardTrainer) with DDP, FSDP or FSDP2, on GPUs (NCCL) or CPU (gloo).

    torchrun --nproc_per_node=N recipes/reward.py --config configs/demo-reward.yaml [key.sub=value ...]
    python recipes/reward.py --help-config                     # every key (finetune's plus reward.*)

The recipe is llmtrain.recipes.reward.Reward (llmtrain/recipes/reward.py); this script only runs it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout, installed or not

from llmtrain import distributed
from llmtrain.recipes.reward import Reward

if __name__ == "__main__":
    distributed.hard_exit(Reward().main())
