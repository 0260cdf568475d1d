"""Shared settings of the paper's models (arXiv 2312.12705, FRONTIER.md): not a config itself.

configs/22b.py, 175b.py and 1t.py call `paper_config(size, layout)`.
"""

from jaxfrontier import config as config_lib


def paper_config(size, *, tensor, pipeline, data, micro_batch, accum, fsdp=1, schedule='1f1b'):
    """The authors' training settings with a given parallel layout."""
    c = config_lib.model_size_config(config_lib.base_config(), size)
    c.model.update(seq_len=2048, vocab_size=50257, vocab_multiple=128, dtype='bfloat16', remat='full',
                   init_std=0.006, tied_embeddings=True, attention='auto')
    c.mesh.update(pipeline=pipeline, data=data, fsdp=fsdp, tensor=tensor)
    c.pipeline.update(schedule=schedule, virtual_stages=1)
    c.sharding.zero1 = True  # the paper's ZeRO stage 1
    c.train.update(steps=1000, micro_batch=micro_batch, accum_steps=accum,
                   global_batch=micro_batch * accum * data * fsdp, log_every=1, eval_every=100, eval_batches=1)
    c.optim.update(lr=6e-5, min_lr=6e-6, warmup_steps=100, b1=0.9, b2=0.95, weight_decay=0.1, clip_norm=1.0)
    c.data.kind = 'synthetic'
    return c
