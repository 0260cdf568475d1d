"""1T GPT (Megatron's 1T shape: 128 layers, hidden 25,600, 160 heads) with the layout of the
authors and of Megatron-LM: TP 8 x PP 64 x DP 6 on 3,072 GCDs, micro-batch 1, global batch
3,072 (512 accumulation steps), 1F1B schedule, ZeRO-1, full activation checkpointing.

  sbatch --nodes=384 launch/frontier.sbatch configs/1t.py
  python -m jaxfrontier.main --config=configs/1t.py --mode=plan
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paper import paper_config  # pylint: disable=g-import-not-at-top,wrong-import-position


def get_config(arg=None):
    del arg
    return paper_config('1t', tensor=8, pipeline=64, data=6, micro_batch=1, accum=512)
