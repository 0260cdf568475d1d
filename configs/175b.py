"""175B GPT with the authors' layout: TP 4 x PP 16 x DP 2 on 128 GCDs, micro-batch 1, global
batch 1,280 (640 accumulation steps), 1F1B schedule, ZeRO-1, full activation checkpointing.

  sbatch --nodes=16 launch/frontier.sbatch configs/175b.py
  python -m jaxfrontier.main --config=configs/175b.py --mode=plan
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paper import paper_config  # pylint: disable=g-import-not-at-top,wrong-import-position


def get_config(arg=None):
    del arg
    return paper_config('175b', tensor=4, pipeline=16, data=2, micro_batch=1, accum=640)
