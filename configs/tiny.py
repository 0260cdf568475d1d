"""The default: a small GPT on the built-in corpus (Python's own stdlib source, byte-level).

8 simulated CPU devices with data 2 x fsdp 2 x tensor 2; runs in a few minutes on a laptop.

  python -m jaxfrontier.main --config=configs/tiny.py --workdir=workdirs/tiny
"""

from jaxfrontier import config as config_lib


def get_config(arg=None):
    a = config_lib.parse_arg(arg, steps=300)
    c = config_lib.base_config()
    c.model.update(num_layers=2, d_model=128, num_heads=4, seq_len=128, vocab_size=256,
                   vocab_multiple=128, dtype='float32', remat='none', attention='auto')
    c.mesh.update(data=2, fsdp=2, tensor=2, cpu_devices=8)
    c.train.update(steps=a.steps, global_batch=16, micro_batch=4, accum_steps=1, log_every=25,
                   eval_every=100, eval_batches=4)
    c.optim.update(lr=3e-3, min_lr=3e-4, warmup_steps=30, weight_decay=0.1)
    return c
