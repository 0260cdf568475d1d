"""Supervised fine-tuning of a Hugging Face model on conversations (docs/post_training.md).

  python -m jaxfrontier.prepare --sft --input=chats.jsonl --tokenizer=/models/Llama-3.2-1B-Instruct \
      --output=data/chats --val_fraction=0.05 --max_tokens=2049
  python -m jaxfrontier.main --config=configs/sft.py:path=/models/Llama-3.2-1B-Instruct,seq_len=2048,fsdp=8 \
      --config.data.path=data/chats_train.bin --config.data.val_path=data/chats_val.bin --workdir=workdirs/sft
  python -m jaxfrontier.main --config=configs/sft.py:path=... --workdir=workdirs/sft --mode=export \
      --export_format=hf --export_path=out/sft

configs/hf.py's model, weights (`checkpoint.init_params_from` = the directory), mesh and batch
(the same arguments: path, seq_len, data, fsdp, tensor, pipeline, micro_batch, accum), with what
fine-tuning on a token file of `prepare --sft` changes:

- data: `data.loss_mask='auto'` (the file's mask: only the assistant tokens count, in training
  and in the evaluation on `data.val_path`, the held-out conversations) and
  `data.pack_documents=True` (conversations packed into windows attend only within themselves,
  positions restart per conversation);
- optimizer: AdamW, lr 2e-5 (TRL's SFTConfig default), a linear warm-up of 3% of the steps
  (TRL/transformers' `warmup_ratio` convention; at least one step), cosine decay to 10%,
  weight decay 0.0 (transformers' TrainingArguments default, which TRL keeps; decaying a trained
  model's weights towards zero moves it from where pre-training left it);
- compute in bfloat16 with fp32 parameters, optimizer state and loss (`model.dtype`; pass
  `--config.model.dtype=float32` on the CPU for exact checks);
- evaluation every 100 steps on the held-out file.

Everything else is the base config's, overridable on the command line.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf  # pylint: disable=g-import-not-at-top,wrong-import-position

from jaxfrontier import config as config_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

WARMUP_FRACTION = 0.03


def get_config(arg=None):
    a = config_lib.parse_arg(arg, **hf.ARGS, steps=1000)
    c = hf.from_args(a)
    c.data.update(loss_mask='auto', pack_documents=True)
    c.train.update(steps=a.steps, eval_every=100)
    c.optim.update(name='adamw', schedule='cosine', lr=2e-5, min_lr=2e-6, weight_decay=0.0,
                   warmup_steps=max(1, round(WARMUP_FRACTION * a.steps)))
    return c
