"""GPT-3 family models on the synthetic dataset (or your token file) for benchmarking and scaling.

  python -m jaxfrontier.main --config=configs/gpt.py:size=1.3b,tensor=2 --workdir=workdirs/gpt1.3b
  python -m jaxfrontier.main --config=configs/gpt.py:size=125m --config.data.kind=tokens \
      --config.data.path=/data/owt_train.bin

Sizes: 125m, 350m, 1.3b, 6.7b (also 22b, 175b, 1t, though configs/22b.py etc. carry their
paper layouts). Mesh: every device on data parallelism unless `data/fsdp/tensor` are given.
"""

from jaxfrontier import config as config_lib


def get_config(arg=None):
    a = config_lib.parse_arg(arg, size='125m', data=1, fsdp=1, tensor=1, micro_batch=8, accum=1)
    c = config_lib.model_size_config(config_lib.base_config(), a.size)
    c.model.update(seq_len=2048, vocab_size=50257, vocab_multiple=128, dtype='bfloat16', remat='full',
                   init_std=0.02, tied_embeddings=True)
    c.mesh.update(data=a.data, fsdp=a.fsdp, tensor=a.tensor)
    dp = a.data * a.fsdp
    c.train.update(steps=1000, micro_batch=a.micro_batch, accum_steps=a.accum,
                   global_batch=a.micro_batch * a.accum * dp, log_every=10, eval_every=200)
    c.optim.update(lr=6e-4, min_lr=6e-5, warmup_steps=100)
    c.data.kind = 'synthetic'
    return c
