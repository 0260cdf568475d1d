"""Building blocks of the models, by concern; this front door re-exports what the families import.

  base.py       ACT_ND (the flat activations' logical names), `param` (fp32, logical names), `dropout`
  linear.py     the one matmul seam every weight matmul goes through (dtype policy; where fp8 and LoRA go)
  norms.py      LayerNorm, RMSNorm
  mlp.py        MLP (GeLU), SwiGLU
  embedding.py  the vocabulary-parallel `embedding_lookup`; `lookup_rows` (a table gathered locally)
  loss.py       `cross_entropy`
  rope.py       rotary position embeddings
"""

from jaxfrontier.model.layers.base import ACT_ND, dropout, param  # noqa: F401
from jaxfrontier.model.layers.embedding import embedding_lookup, lookup_rows  # noqa: F401
from jaxfrontier.model.layers.loss import cross_entropy  # noqa: F401
from jaxfrontier.model.layers.mlp import MLP, SwiGLU  # noqa: F401
from jaxfrontier.model.layers.norms import LayerNorm, RMSNorm  # noqa: F401
