"""Direct Preference Optimization of a fine-tuned model on preference pairs (docs/post_training.md).

  python -m jaxfrontier.prepare --dpo --input=pairs.jsonl --tokenizer=/models/Llama-3.2-1B-Instruct \
      --output=data/pairs --seq_len=2048 --val_fraction=0.05
  python -m jaxfrontier.main --config=configs/dpo.py:path=/models/Llama-3.2-1B-Instruct,seq_len=2048,fsdp=8 \
      --config.data.path=data/pairs_train.bin --config.data.val_path=data/pairs_val.bin --workdir=workdirs/dpo

configs/sft.py's model, weights, mesh and optimizer (path: a Hugging Face directory; to start from
an SFT run of ours, add --config.checkpoint.init_params_from=<its workdir>), with what DPO changes:
`train.objective='dpo'` (training/dpo.py) with `train.dpo_beta=0.1` and a learning rate of 5e-7
(TRL's DPOConfig: beta 0.1, lr 1e-6; Zephyr's and Tulu's recipes 5e-7), the reference model a
frozen copy of the starting parameters; data: rows of pairs from `prepare --dpo` (row 2i chosen,
2i + 1 rejected, not packed), micro_batch 2 (one pair per replica at least; must be even). The
evaluation reports the DPO loss, reward margins and accuracy on the held-out pairs
(`eval/dpo/*`). Everything else overridable on the command line.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf  # pylint: disable=g-import-not-at-top,wrong-import-position
import sft  # pylint: disable=g-import-not-at-top,wrong-import-position

from jaxfrontier import config as config_lib  # pylint: disable=g-import-not-at-top,wrong-import-position


def get_config(arg=None):
    a = config_lib.parse_arg(arg, **{**hf.ARGS, 'micro_batch': 2}, steps=1000)
    c = sft.get_config(','.join(f'{k}={v}' for k, v in a.items()))
    c.data.update(pack_documents=False, loss_mask='on')
    c.train.update(objective='dpo', dpo_beta=0.1)
    c.optim.update(lr=5e-7, min_lr=5e-8)
    return c
