"""22B GPT with the authors' layout on Frontier: TP 4 x PP 8 x DP 1 on 32 GCDs, micro-batch 2.

  sbatch --nodes=4 launch/frontier.sbatch configs/22b.py
  python -m jaxfrontier.main --config=configs/22b.py --mode=plan

The authors' global batch is not public; 64 accumulation steps (global batch 128) keep the
pipeline bubble (P - 1) / (M + P - 1) under 10 %.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paper import paper_config  # pylint: disable=g-import-not-at-top,wrong-import-position


def get_config(arg=None):
    del arg
    return paper_config('22b', tensor=4, pipeline=8, data=1, micro_batch=2, accum=64)
