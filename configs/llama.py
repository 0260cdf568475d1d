"""Llama-family models with the published shapes of Llama 3.2 1B/3B and Llama 3.1 8B/70B/405B.

  python -m jaxfrontier.main --config=configs/llama.py:size=tiny --workdir=workdirs/llama_tiny
  python -m jaxfrontier.main --config=configs/llama.py:size=8b --mode=plan --hardware=mi250x
  python -m jaxfrontier.main --config=configs/llama.py:size=1b,tensor=2 --config.data.kind=tokens \
      --config.data.path=/data/my_tokens.bin

Each size sets Meta's shape: layers, width, query and key/value heads, the SwiGLU width,
vocabulary 128,256, RoPE theta 500,000 with Llama 3.1's frequency scaling, and the tied
(1B, 3B) or untied head. `tiny` is a small model for tests and laptops (byte vocabulary,
grouped-query attention with 2 kv heads for 4 query heads). Mesh: every device on data
parallelism unless `data/fsdp/tensor/pipeline` are given.
"""

from jaxfrontier import config as config_lib
from jaxfrontier.errors import ConfigError

# size -> (layers, d_model, heads, kv heads, mlp width, tied head, rope factor).
# Hugging Face config.json of meta-llama/Llama-3.2-1B, -3.2-3B, -3.1-8B, -3.1-70B, -3.1-405B.
SIZES = {
    'tiny': (2, 128, 4, 2, 384, False, 8.0),
    '1b': (16, 2048, 32, 8, 8192, True, 32.0),
    '3b': (28, 3072, 24, 8, 8192, True, 32.0),
    '8b': (32, 4096, 32, 8, 14336, False, 8.0),
    '70b': (80, 8192, 64, 8, 28672, False, 8.0),
    '405b': (126, 16384, 128, 8, 53248, False, 8.0),
}


def get_config(arg=None):
    a = config_lib.parse_arg(arg, size='tiny', data=0, fsdp=1, tensor=1, pipeline=1, micro_batch=1, accum=1)
    if a.size not in SIZES:
        raise ConfigError('<arg>.size', a.size, 'unknown Llama size', f'use one of {sorted(SIZES)}')
    layers, d, heads, kv, mlp, tied, factor = SIZES[a.size]
    c = config_lib.base_config()
    c.model.update(family='llama', num_layers=layers, d_model=d, num_heads=heads, num_kv_heads=kv, mlp_dim=mlp,
                   tied_embeddings=tied, norm_eps=1e-5, rope_theta=500000.0, rope_scaling='llama3',
                   rope_factor=factor, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                   rope_original_max_len=8192, init_std=0.02, remat='full')
    if a.size == 'tiny':
        c.model.update(seq_len=128, vocab_size=256, vocab_multiple=128, dtype='float32', remat='none')
        c.mesh.update(data=a.data or 1, fsdp=a.fsdp, tensor=a.tensor, pipeline=a.pipeline)
        dp = c.mesh.data * c.mesh.fsdp  # 16 sequences a step: micro-batches of 4 accumulated where dp < 4
        accum = max(1, 16 // (4 * dp))
        c.train.update(steps=300, global_batch=16, micro_batch=16 // (accum * dp), accum_steps=accum,
                       log_every=25, eval_every=100)
        c.optim.update(lr=3e-3, min_lr=3e-4, warmup_steps=30)
        return c
    c.model.update(seq_len=8192, vocab_size=128256, vocab_multiple=128, dtype='bfloat16')
    c.mesh.update(data=a.data or 1, fsdp=a.fsdp, tensor=a.tensor, pipeline=a.pipeline)
    dp = c.mesh.data * c.mesh.fsdp
    c.train.update(steps=1000, micro_batch=a.micro_batch, accum_steps=a.accum,
                   global_batch=a.micro_batch * a.accum * dp, log_every=10, eval_every=200)
    c.optim.update(lr=3e-4, min_lr=3e-5, warmup_steps=100)
    c.data.kind = 'synthetic'
    return c
