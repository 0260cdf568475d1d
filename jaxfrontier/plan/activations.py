"""What the backward pass keeps: the model's saved residuals, read from JAX itself.

Which arrays autodiff saves between the forward and the backward pass depends on the model
code, the remat policy, the compute dtype and dropout. Rather than a hand-written table that
drifts from `model/`, the planner traces a tiny proxy of the family's model once per (policy,
dtype, ...) with `saved_residuals` and reads each residual's shape in symbols: the proxy's sizes are distinct
numbers, so every dimension names itself (batch rows, tokens, heads, ...). `Residual.local_bytes`
then evaluates a residual for any model size and layout, per device.

Symbols: b micro-batch rows, t sequence, n = b*t tokens, h heads, k head dim, d model dim,
f MLP dim, v vocabulary, q the 3 of the fused QKV, 1 a unit dimension.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax._src.ad_checkpoint import saved_residuals  # public only as print_saved_residuals

from jaxfrontier import config as config_lib
from jaxfrontier.model.params import ModelDef

# Proxy sizes: pairwise distinct, so a dimension's size names its symbol.
_B, _T, _H, _K, _V, _L = 2, 7, 5, 11, 17, 19
_D = _H * _K


@dataclasses.dataclass(frozen=True)
class Residual:
    """One saved array, per layer (block residuals) or once (embedding and head)."""

    dims: tuple[str, ...]  # symbols, see the module docstring
    itemsize: int
    source: str  # what JAX says produced it

    @property
    def is_weight(self) -> bool:
        """A copy of a weight (e.g. its bf16 cast): has no batch or token dimension."""
        return not set(self.dims) & {'b', 't', 'n'}

    def local_bytes(self, sizes: dict[str, int]) -> int:
        """Bytes per device, with `sizes` the per-device size of every symbol."""
        return self.itemsize * math.prod(sizes[s] for s in self.dims)


@dataclasses.dataclass(frozen=True)
class Signature:
    """The residuals of one remat policy: per block, and for the embedding + head."""

    block: tuple[Residual, ...]
    head: tuple[Residual, ...]


def local_sizes(*, micro_batch: int, seq_len: int, num_heads: int, head_dim: int, d_model: int, mlp_dim: int,
                vocab: int, tensor: int, fsdp: int, weight: bool) -> dict[str, int]:
    """Per-device size of each symbol under the default rules (heads, MLP, vocab over tensor).

    Activations keep the whole model dimension; weight copies are split over fsdp there.
    """
    return {'b': micro_batch, 't': seq_len, 'n': micro_batch * seq_len, 'h': -(-num_heads // tensor),
            'k': head_dim, 'd': -(-d_model // fsdp) if weight else d_model, 'f': -(-mlp_dim // tensor),
            'v': -(-vocab // tensor), 'q': 3, '1': 1}


def _symbols(mlp_dim: int) -> dict[int, str]:
    # mlp_dim == d_model (model.mlp_ratio=1): 'f' is 'd', the same bytes (it collided, tests/fuzz)
    table = {_B: 'b', _T: 't', _B * _T: 'n', _H: 'h', _K: 'k', mlp_dim: 'f', _D: 'd', _V: 'v', 3: 'q', 1: '1'}
    if len(table) != 10 - (mlp_dim == _D):
        raise ValueError(f'proxy sizes collide for MLP width {mlp_dim}; change the proxy sizes in activations.py')
    return table


@functools.cache
def signature(remat: str, dtype: str, mlp_ratio: int = 4, dropout: bool = False,
              tied_embeddings: bool = True, attention: str = 'xla', family: str = 'gpt') -> Signature:
    """Residuals the model saves for the backward pass under one policy (traced, cached).

    Args:
      remat: the remat policy ('none', 'full', 'save_dots', 'save_dots_no_batch').
      dtype: compute dtype.
      mlp_ratio: MLP width / model width.
      dropout: whether dropout is on (its masks are residuals).
      tied_embeddings: whether the head reuses the embedding.
      attention: attention kernel (an 'auto' resolves on this machine's backend).
      family: the model family (`config.model.family`) whose module is traced.

    Returns:
      The per-block and the embedding + head residuals, in symbols.

    The cuDNN kernel cannot be traced without an NVIDIA GPU: its signature is the XLA
    kernel's without the `b h t t` score, probability and mask arrays, plus the fused
    kernel's fp32 softmax statistics `b h t` (what flash attention keeps).
    """
    if attention in ('cudnn', 'blockwise'):
        xla = signature(remat, dtype, mlp_ratio, dropout, tied_embeddings, 'xla', family)
        fused = lambda rs: tuple(r for r in rs if r.dims.count('t') < 2)
        stats = (Residual(('b', 'h', 't'), 4, f'{attention} softmax statistics'),) if remat in ('none', 'save_dots') else ()
        return Signature(fused(xla.block) + stats, fused(xla.head))
    shape = config_lib.ModelShape(
        num_layers=_L, d_model=_D, num_heads=_H, seq_len=_T, vocab_size=_V, real_vocab_size=_V,
        mlp_dim=mlp_ratio * _D, tied_embeddings=tied_embeddings, dropout_rate=0.1 if dropout else 0.0,
        init_std=0.02, dtype=dtype, attention=attention, remat=remat, family=family)
    names = _symbols(shape.mlp_dim)
    model_def = ModelDef.create(shape)
    tokens = jax.ShapeDtypeStruct((_B, _T), jnp.int32)
    key = jax.random.key(0) if dropout else None

    def loss(p, tokens_bt):
        return model_def.bind(p).loss(tokens_bt, tokens_bt, key)

    block, head = [], []
    for aval, source in saved_residuals(loss, model_def.abstract_params(), tokens):
        if source.startswith('from the argument'):
            continue  # parameters and inputs are in memory anyway
        if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key) or tuple(aval.shape) == (_L,):
            continue  # dropout's key and per-layer seeds: bytes, not activations (crashed --mode=plan; tests/fuzz)
        dims = tuple(aval.shape)
        stacked = 'output of scan' in source and dims[:1] == (_L,)
        dims = dims[1:] if stacked else dims
        if any(size not in names for size in dims):
            raise ValueError(f'residual {aval.str_short()} ({source}) has a dimension the planner cannot name')
        entry = Residual(tuple(names[s] for s in dims), jnp.dtype(aval.dtype).itemsize, source.split(' from ')[0])
        (block if stacked else head).append(entry)
    return Signature(tuple(block), tuple(head))


def residual_bytes(residuals: tuple[Residual, ...], act_sizes: dict[str, int], weight_sizes: dict[str, int]) -> int:
    """Per-device bytes of `residuals` (weight copies sized with `weight_sizes`)."""
    return sum(r.local_bytes(weight_sizes if r.is_weight else act_sizes) for r in residuals)
