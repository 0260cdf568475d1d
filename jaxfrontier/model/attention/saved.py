"""What the attention kernels keep for their backward, named for remat policies.

The fused kernels' forward rules (blockwise.py's plain and masked paths, ring.py) name their output
`attention_output` and their softmax statistics `attention_stats` (`keep`); the others name their
output (`name_output`: reference, xla, cudnn in `dot_product_attention`). `model.remat=save_dots_attention`
(model/stack.py) saves what carries these names beside the weight matmuls' outputs, so the backward
recomputes only element-wise work and runs no attention forward again. cuDNN's statistics are JAX's own,
unnamed: under that policy its forward runs again in the backward.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

OUTPUT, STATS = 'attention_output', 'attention_stats'
NAMES = (OUTPUT, STATS)


def name_output(o: jax.Array) -> jax.Array:
    """A kernel's output under its checkpoint name."""
    return checkpoint_name(o, OUTPUT)


def keep(o: jax.Array, stats):
    """A fused kernel's output and its softmax statistics (any pytree of arrays) under their names."""
    return name_output(o), jax.tree.map(lambda a: checkpoint_name(a, STATS), stats)
