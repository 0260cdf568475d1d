"""What the backward pass keeps: the model's saved residuals, read from JAX itself.

Which arrays autodiff saves between the forward and the backward pass depends on the model
code, the remat policy, the compute dtype and dropout. Rather than a hand-written table that
drifts from `model/`, the planner traces a tiny proxy of the family's model once per (policy,
dtype, ...) with `saved_residuals` and reads each residual's shape in symbols: the proxy's sizes are distinct
numbers, so every dimension names itself (batch rows, tokens, heads, ...). `Residual.local_bytes`
then evaluates a residual for any model size and layout, per device.

The proxy is the configured family's model (a fused QKV and a GeLU MLP; or grouped key/value
heads, rotary tables and a gated MLP, whose gate and up projections add F-wide arrays and
whose k/v are g, not h, heads wide; QK-norm's statistics), with the family's choices its
declaration names (`Family.proxy_choice` / `proxy_fields`), so nothing here knows a family's
layer by name. A model whose heads are not d / h wide gets a proxy whose d is not h k either, so
an array h k wide never passes for a d-wide one.

Symbols: b micro-batch rows, t sequence, n = b*t tokens, h heads, g key/value heads, r = h/g
query heads per key/value head, k head dim, c = k/2 (the rotary half), d model dim, f MLP
dim, v vocabulary, q the 3 of a fused QKV, s the 2 of a fused k/v, 1 a unit dimension.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import math
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
from jax._src.ad_checkpoint import saved_residuals  # public only as print_saved_residuals

from jaxfrontier import config as config_lib
from jaxfrontier import families
from jaxfrontier import files
from jaxfrontier.model import params as params_lib
from jaxfrontier.model.params import ModelDef

# Proxy sizes: pairwise distinct (and distinct from every product a residual could carry), so
# a dimension's size names its symbol. The head dim is even (rotary embeddings rotate pairs);
# a family whose model groups its k/v heads gets 5 k/v heads of 4 query heads each in its proxy
# (`PROXY_SIZES`), and the MLP has a width of its own (any width: 'f' is a name).
_B, _T, _G, _R, _C, _F, _V, _L = 6, 7, 5, 4, 13, 29, 17, 19
_H, _K = _G * _R, 2 * _C
_D = _H * _K
_D_APART = 11 * 23  # the width of a proxy whose heads are not d / h wide (h k = 520 apart from it)
# What a family's proxy_fields may use: heads, k/v heads, the head width, a model width apart from h k.
PROXY_SIZES = {'h': _H, 'g': _G, 'k': _K, 'd_apart': _D_APART}


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

    @property
    def is_stream(self) -> bool:
        """An array of the residual stream [tokens, d] (norms, dropout, residual adds): split over
        tensor too with sequence parallelism."""
        return 'n' in self.dims and 'd' in self.dims and set(self.dims) <= {'n', 'd', '1'}

    def local_bytes(self, sizes: dict[str, int]) -> int:
        """Bytes per device, with `sizes` the per-device size of every symbol.

        With context parallelism `t` is the local part of the sequence; a second `t` (attention
        scores against every key, which the all-gather kernel holds) is `t_keys`, the whole one.
        A stream array divides by `sizes['stream']` (sequence parallelism's split).
        """
        dims = list(self.dims)
        if dims.count('t') > 1:
            dims[len(dims) - 1 - dims[::-1].index('t')] = 't_keys'
        size = math.prod(sizes.get(s, sizes['t']) if s == 't_keys' else sizes[s] for s in dims)
        if self.is_stream:
            size = -(-size // sizes.get('stream', 1))
        return self.itemsize * size


@dataclasses.dataclass(frozen=True)
class Signature:
    """The residuals of one remat policy: per block, and for the embedding + head."""

    block: tuple[Residual, ...]
    head: tuple[Residual, ...]


def local_sizes(*, micro_batch: int, seq_len: int, num_heads: int, head_dim: int, d_model: int, mlp_dim: int,
                vocab: int, tensor: int, fsdp: int, weight: bool, kv_heads: int = 0, context: int = 1,
                stream: int = 1) -> dict[str, int]:
    """Per-device size of each symbol under the default rules (heads, MLP, vocab over tensor).

    Activations keep the whole model dimension; weight copies are split over fsdp there.
    Key/value heads (`kv_heads`, 0: as many as query heads) split over tensor where they
    divide it and are whole otherwise (`config.resolve_rules`). `context` splits the sequence
    (t, n; `t_keys` stays whole: keys gathered for the scores); `stream` is the residual
    stream's further split (mesh.tensor with sequence parallelism, else 1).
    """
    t_local = -(-seq_len // context)
    g = kv_heads or num_heads
    g_local = g // tensor if g % tensor == 0 else g
    h_local = -(-num_heads // tensor)
    return {'b': micro_batch, 't': t_local, 't_keys': seq_len, 'n': micro_batch * t_local, 'stream': stream,
            'h': h_local,
            'g': g_local, 'r': max(1, h_local // g_local), 'k': head_dim, 'c': head_dim // 2,
            'd': -(-d_model // fsdp) if weight else d_model, 'f': -(-mlp_dim // tensor),
            'v': -(-vocab // tensor), 'q': 3, 's': 2, '1': 1}


def _symbols(grouped: bool, d_model: int) -> dict[int, str]:
    table = {_B: 'b', _T: 't', _B * _T: 'n', _H: 'h', _K: 'k', _C: 'c', _F: 'f', d_model: 'd', _V: 'v', 3: 'q',
             2: 's', 1: '1'}
    if grouped:
        table |= {_G: 'g', _R: 'r'}
    assert len(table) == 12 + 2 * grouped, 'proxy sizes collide'  # pairwise distinct by construction
    return table


@functools.cache
def _code_digest() -> str:
    """What a traced signature depends on besides its arguments: the model code, the family declarations,
    this module, JAX and Flax."""
    import flax  # pylint: disable=g-import-not-at-top
    digest = hashlib.sha256(f'{jax.__version__} {flax.__version__}'.encode())
    here = pathlib.Path(__file__)
    for path in sorted((here.parents[1] / 'model').rglob('*.py')) + sorted(
            (here.parents[1] / 'families').rglob('*.py')) + [here]:
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _module_digest(family: str) -> str:
    """The source of the family's NNX module: part of the key where it lives outside model/ (a test's family)."""
    return hashlib.sha256(pathlib.Path(inspect.getfile(params_lib.module_of(family))).read_bytes()).hexdigest()


def _cache_root() -> str | None:
    """JAX's persistent compilation cache directory of this process, if one is set."""
    return jax.config.jax_compilation_cache_dir


def _disk_path(args: tuple) -> str | None:
    """Where a traced signature is kept beside JAX's persistent compilation cache (None: no cache)."""
    directory = _cache_root()
    if not directory:
        return None
    family = args[5] if len(args) > 5 else families.DEFAULT_FAMILY
    key = hashlib.sha256(json.dumps([list(args), _code_digest(), _module_digest(family)]).encode()).hexdigest()[:32]
    return os.path.join(directory, 'jaxfrontier-residuals', f'{key}.json')


def _load(path: str | None) -> Signature | None:
    if path is None:
        return None
    try:
        with open(path, encoding='utf-8') as f:
            raw = json.load(f)
        return Signature(*(tuple(Residual(tuple(r['dims']), int(r['itemsize']), str(r['source'])) for r in part)
                           for part in (raw['block'], raw['head'])))
    except (TypeError, OSError, ValueError, KeyError):  # none yet, or unreadable: traced again
        return None


def _store(path: str | None, sig: Signature) -> None:
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        files.write_atomic(path, json.dumps({'block': [dataclasses.asdict(r) for r in sig.block],
                                             'head': [dataclasses.asdict(r) for r in sig.head]}))
    except OSError:
        pass  # a read-only or full cache: the next run traces again


@functools.cache
def signature(remat: str, dtype: str, dropout: bool = False, tied_embeddings: bool = True, attention: str = 'xla',
              family: str = families.DEFAULT_FAMILY, proxy: Any = False) -> Signature:
    """Residuals the model saves for the backward pass under one policy (traced, cached).

    Cached in this process, and on disk beside JAX's persistent compilation cache when one is
    set (main: train.compile_cache), keyed by the arguments, JAX's and Flax's versions and the
    model code: the trace is most of the pre-flight's second of start-up, and a warm start
    reads it back instead.

    Args:
      remat: the remat policy (config.REMAT_POLICIES).
      dtype: compute dtype.
      dropout: whether dropout is on (its masks are residuals).
      tied_embeddings: whether the head reuses the embedding.
      attention: attention kernel (an 'auto' resolves on this machine's backend).
      family: the model family (`config.model.family`) whose module is traced.
      proxy: the family's choices the proxy keeps (`Family.proxy_choice`; e.g. grouped k/v heads).

    Returns:
      The per-block and the embedding + head residuals, in symbols.

    The cuDNN kernel cannot be traced without an NVIDIA GPU: its signature is the XLA
    kernel's without the `b h t t` score, probability and mask arrays, plus the fused
    kernel's fp32 softmax statistics `b h t` (what flash attention keeps) where the policy keeps
    them (save_dots_attention: blockwise's, which are named; cuDNN's are JAX's own).
    """
    if attention in ('cudnn', 'blockwise'):
        xla = signature(remat, dtype, dropout, tied_embeddings, 'xla', family, proxy)
        fused = lambda rs: tuple(r for r in rs if r.dims.count('t') < 2)
        # Blockwise keeps them per whole query block: b h t where t is a multiple of attention_block_q.
        kept = remat in ('none', 'save_dots') or (remat == 'save_dots_attention' and attention == 'blockwise')
        stats = (Residual(('b', 'h', 't'), 4, f'{attention} softmax statistics'),) if kept else ()
        return Signature(fused(xla.block) + stats, fused(xla.head))
    path = _disk_path((remat, dtype, dropout, tied_embeddings, attention, family, proxy))
    kept = _load(path)
    if kept is not None:
        return kept
    sig = _trace(remat, dtype, dropout, tied_embeddings, attention, family, proxy)
    _store(path, sig)
    return sig


def _trace(remat: str, dtype: str, dropout: bool, tied_embeddings: bool, attention: str, family: str,
           proxy: Any) -> Signature:
    """`signature`, traced: the proxy model's saved residuals in symbols."""
    declared = families.get(family)
    shape = declared.shape_type(**dict(
        num_layers=_L, d_model=_D, num_heads=_H, seq_len=_T, vocab_size=_V, real_vocab_size=_V,
        mlp_dim=_F, tied_embeddings=tied_embeddings, dropout_rate=0.1 if dropout else 0.0,
        init_std=0.02, dtype=dtype, attention=attention, remat=remat, family=family) |
        declared.proxy_fields(proxy, PROXY_SIZES))
    names = _symbols(shape.kv_heads != shape.num_heads, shape.d_model)
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


def for_shape(shape: config_lib.ModelShape, remat: str, attention: str) -> Signature:
    """The signature of `shape`'s model under `remat` and the `attention` kernel."""
    return signature(remat, shape.dtype, shape.dropout_rate > 0, shape.tied_embeddings, attention, shape.family,
                     families.get(shape.family).proxy_choice(shape))


def act_sizes(shape: config_lib.ModelShape, micro_batch: int, tensor: int, fsdp: int,
              weight: bool, context: int = 1, sequence_parallel: bool = False) -> dict[str, int]:
    """`local_sizes` of `shape` on a layout (weight=True: the sizes of weight copies)."""
    return local_sizes(micro_batch=micro_batch, seq_len=shape.seq_len, num_heads=shape.num_heads,
                       head_dim=shape.head_dim, d_model=shape.d_model, mlp_dim=shape.mlp_dim,
                       vocab=shape.vocab_size, tensor=tensor, fsdp=fsdp, weight=weight,
                       kv_heads=shape.kv_heads, context=context, stream=tensor if sequence_parallel else 1)


def residual_bytes(residuals: tuple[Residual, ...], act_sizes: dict[str, int], weight_sizes: dict[str, int]) -> int:
    """Per-device bytes of `residuals` (weight copies sized with `weight_sizes`)."""
    return sum(r.local_bytes(weight_sizes if r.is_weight else act_sizes) for r in residuals)
