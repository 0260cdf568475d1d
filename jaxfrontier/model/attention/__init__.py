"""Causal self-attention: GPT's projections, and the kernels and KV cache every family uses.

A family projects queries [B, T, H, K] and keys/values of G <= H heads (grouped-query
attention; GPT: G = H) and calls `attend`, which repeats kv heads to the query heads before
the kernel. With a KV cache (decoding, model/decode.py) the cache holds the G kv heads and
the queries attend to it (`cached_attention`, fp32 scores as in `reference_attention`).

Each kernel also takes the tokens' positions and segments (`visible`'s mask: packed
documents, context parallelism's token order; docs/models.md): reference and xla as a
[B, 1, T, T] mask, cudnn as JAX's additive bias from that mask, blockwise by block pair,
skipping wholly masked pairs. Without them each runs its plain causal program.

Every kernel names its output, the fused kernels their softmax statistics too (saved.py), for
`model.remat=save_dots_attention`; reference and xla then recompute only their probabilities.

Kernels (config.model.attention):
  reference  einsum + causal mask + fp32 softmax, written out here; runs everywhere.
  xla        jax.nn.dot_product_attention(implementation='xla').
  cudnn      jax.nn.dot_product_attention(implementation='cudnn'): NVIDIA GPUs, 16-bit dtypes.
  blockwise  flash-style blocks, online softmax and a recomputing custom VJP in plain JAX
             (model/attention/blockwise.py): O(s) memory per head on any backend; block sizes from
             model.attention_block_q / model.attention_block_kv.
  auto       cudnn on an NVIDIA GPU with a 16-bit dtype; blockwise everywhere else: on ROCm
             (the Pallas/Triton kernels do not run on MI250X, FRONTIER.md, so the alternative
             is XLA's s x s scores), on NVIDIA in fp32, and on the CPU, where it measured
             faster than reference forward + backward at every length tried (batch 8, 6 heads,
             2 busy cores: sequence 256 111 vs 157 ms, 2048 5.3 vs 15.9 s;
             benchmarks/attention.py, docs/PERFORMANCE.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfrontier import mesh as mesh_lib
from jaxfrontier.families import Lora
from jaxfrontier.model.attention import ring, saved
from jaxfrontier.model.attention.blockwise import blockwise_attention
from jaxfrontier.model.context import flatten_tokens, unflatten_tokens
from jaxfrontier.model.layers import linear
from jaxfrontier.model.layers.base import ACT_ND, param
from jaxfrontier.model.sequence import Seq, as_seq, positions

ACT_BTHK = ('batch', 'length', 'heads', None)
ACT_BTGK = ('batch', 'length', 'kv_heads', None)  # keys and values, also one layer's KV cache [B, S, G, K]
ACT_BSHK_WHOLE = ('batch', None, 'heads', None)  # keys / values gathered over the context axis
KVCache = dict[str, jax.Array]  # one layer's {'k', 'v'} [B, S, G, K] (model/decode.py)


def resolve_impl(impl: str, dtype: jnp.dtype, backend: str | None = None) -> str:
    """The kernel `auto` stands for on this backend and dtype; other names pass through."""
    if impl != 'auto':
        return impl
    backend = backend or jax.default_backend()
    if backend == 'cpu':
        return 'blockwise'
    is_nvidia = backend in ('gpu', 'cuda') and 'nvidia' in jax.devices()[0].device_kind.lower()
    return 'cudnn' if is_nvidia and jnp.dtype(dtype).itemsize == 2 else 'blockwise'


def visible(t: int, positions_bt: jax.Array | None = None, segments_bt: jax.Array | None = None) -> jax.Array:
    """The attention mask of self-attention among T tokens: [T, T], or [B, T, T] with positions or
    segments. Query i sees key j where pos_j <= pos_i and both are in one segment (document)."""
    if positions_bt is None:
        mask = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    else:
        mask = positions_bt[:, :, None] >= positions_bt[:, None, :]
    if segments_bt is not None:
        mask = mask & (segments_bt[:, :, None] == segments_bt[:, None, :])
    return mask


def reference_attention(q_bthk: jax.Array, k_bshk: jax.Array, v_bshk: jax.Array,
                        positions_bt: jax.Array | None = None, segments_bt: jax.Array | None = None) -> jax.Array:
    """Causal softmax(q k^T / sqrt(k)) v with fp32 scores and softmax (masked by `visible`).

    Every query sees at least itself, so no row is wholly masked.
    """
    scale = q_bthk.shape[-1] ** -0.5
    s_bhts = jnp.einsum('bthk,bshk->bhts', q_bthk, k_bshk, preferred_element_type=jnp.float32) * scale
    mask = visible(s_bhts.shape[-1], positions_bt, segments_bt)
    mask = mask if mask.ndim == 2 else mask[:, None]  # [T, S] or [B, 1, T, S]
    s_bhts = jnp.where(mask, s_bhts, jnp.finfo(jnp.float32).min)
    p_bhts = jax.nn.softmax(s_bhts, axis=-1).astype(v_bshk.dtype)
    return jnp.einsum('bhts,bshk->bthk', p_bhts, v_bshk)


def cached_attention(q_bthk: jax.Array, k_bshk: jax.Array, v_bshk: jax.Array, pos_bt: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(K)) v over a KV cache; the query at position p sees keys 0..p (fp32 scores)."""
    scale = q_bthk.shape[-1] ** -0.5
    s_bhts = jnp.einsum('bthk,bshk->bhts', q_bthk, k_bshk, preferred_element_type=jnp.float32) * scale
    visible_bts = jnp.arange(k_bshk.shape[1])[None, None, :] <= pos_bt[:, :, None]
    s_bhts = jnp.where(visible_bts[:, None], s_bhts, jnp.finfo(jnp.float32).min)
    p_bhts = jax.nn.softmax(s_bhts, axis=-1).astype(v_bshk.dtype)
    return jnp.einsum('bhts,bshk->bthk', p_bhts, v_bshk)


def write_cache(cache_bshk: jax.Array, new_bthk: jax.Array, pos_bt: jax.Array) -> jax.Array:
    """Writes new keys or values at their positions: a prefill (T > 1) starts at 0, a step (T = 1) at pos."""
    if new_bthk.shape[1] > 1:
        return jax.lax.dynamic_update_slice(cache_bshk, new_bthk, (0, 0, 0, 0))
    at_bs = jnp.arange(cache_bshk.shape[1])[None, :] == pos_bt  # [B, S]: one position per row
    return jnp.where(at_bs[:, :, None, None], new_bthk, cache_bshk)


def repeat_kv(x_bsgk: jax.Array, num_heads: int) -> jax.Array:
    """Grouped-query attention: G key/value heads -> H, query head i reading kv head i // (H/G).

    transformers' `repeat_kv` order, so Hugging Face weights need no permutation. Contiguous
    groups also keep a tensor split local: rank r's query heads use exactly rank r's kv heads
    where G divides the tensor size, and where kv heads are replicated each rank slices the
    repeat to its own query heads.
    """
    groups = num_heads // x_bsgk.shape[2]
    return x_bsgk if groups == 1 else jnp.repeat(x_bsgk, groups, axis=2)


def attend(q_bthk: jax.Array, k_btgk: jax.Array, v_btgk: jax.Array, impl: str, blocks: tuple[int, int],
           cache: KVCache | None = None, positions_bt: jax.Array | None = None,
           seq: int | Seq | None = None) -> tuple[jax.Array, KVCache | None]:
    """Attention of projected queries [B, T, H, K] over keys/values of G <= H heads [B, T, G, K].

    Training (no cache): causal attention among the T tokens with the configured kernel, kv
    heads repeated to the query heads first; `seq` (model/sequence.py) carries the tokens'
    positions and documents where they are not plain (packed documents, context parallelism). Decoding: the new keys and values are written to
    this layer's cache {'k', 'v'} [B, S, G, K] at `positions_bt` (the cache holds G heads) and
    each query attends to the cached keys up to its own position. Returns (output [B, T, H, K],
    the cache or None).
    """
    h = q_bthk.shape[2]
    q_bthk = mesh_lib.constrain(q_bthk, ACT_BTHK)
    k_btgk, v_btgk = (mesh_lib.constrain(x, ACT_BTGK) for x in (k_btgk, v_btgk))
    if cache is None:
        seq = as_seq(q_bthk.shape[1] if seq is None else seq)
        context = mesh_lib.active_axes('length')
        if grouped_blockwise(impl, q_bthk, k_btgk, seq, context):  # no repeat: the kernel packs the groups
            o_bthk = blockwise_attention(q_bthk, k_btgk, v_btgk, *blocks)
            return mesh_lib.constrain(o_bthk, ACT_BTHK), None
        k_bthk, v_bthk = (mesh_lib.constrain(repeat_kv(x, h), ACT_BTHK) for x in (k_btgk, v_btgk))
        if context:  # the sequence is split over devices: attention across them
            o_bthk = across_context(q_bthk, k_bthk, v_bthk, positions_bt=positions(seq, q_bthk.shape[0]),
                                    segments_bt=seq.segments_bt, block_q=blocks[0], block_kv=blocks[1],
                                    axis=context[0] if len(context) == 1 else context)
        else:
            o_bthk = dot_product_attention(q_bthk, k_bthk, v_bthk, impl, *blocks, positions_bt=seq.positions_bt,
                                           segments_bt=seq.segments_bt)
        return mesh_lib.constrain(o_bthk, ACT_BTHK), None
    cache = {name: mesh_lib.constrain(write_cache(cache[name], new, positions_bt), ACT_BTGK)
             for name, new in (('k', k_btgk), ('v', v_btgk))}
    k_bshk, v_bshk = (mesh_lib.constrain(repeat_kv(cache[name], h), ACT_BTHK) for name in ('k', 'v'))
    return mesh_lib.constrain(cached_attention(q_bthk, k_bshk, v_bshk, positions_bt), ACT_BTHK), cache


def grouped_blockwise(impl: str, q_bthk: jax.Array, k_btgk: jax.Array, seq: Seq, context) -> bool:
    """Whether `attend` hands blockwise attention G < H kv heads unrepeated (its causal fast path packs
    each group's query heads, model/attention/blockwise.py): plain causal tokens, no context split, and
    kv heads split over the same mesh axes as the query heads (where they are replicated because G
    does not divide the tensor size, each rank keeps repeating to its own query heads)."""
    if k_btgk.shape[2] == q_bthk.shape[2] or context or not seq.plain:
        return False
    return (resolve_impl(impl, q_bthk.dtype) == 'blockwise'
            and mesh_lib.active_axes('kv_heads') == mesh_lib.active_axes('heads'))


def across_context(q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array, *, positions_bt: jax.Array,
                   segments_bt: jax.Array | None, block_q: int, block_kv: int, axis='context') -> jax.Array:
    """Attention with the sequence split over mesh `axis`: ring attention (model/attention/ring.py), except
    inside the pipeline's stages, where it gathers (`context_attention`).

    Ring attention's collective-permutes inside the pipeline executors' per-stage `lax.switch`
    branches deadlock on XLA:CPU: the permute waits for every device of the program, and only
    one stage's devices reach the branch (docs/long_context.md, "Attention"). The gather's collectives are the
    same in every branch of a stage and do not. Whatever `model.attention` says, the ring runs
    the blockwise kernel and the gather the reference one.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if isinstance(axis, str) and 'pipeline' not in mesh.manual_axes:
        return ring.ring_attention(q_bthk, k_bthk, v_bthk, positions_bt=positions_bt, segments_bt=segments_bt,
                                   block_q=block_q, block_kv=block_kv, axis=axis)
    return context_attention(q_bthk, k_bthk, v_bthk, positions_bt=positions_bt, segments_bt=segments_bt,
                             block_q=block_q, block_kv=block_kv, axis=axis)


def context_attention(q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array, *, positions_bt: jax.Array,
                      segments_bt: jax.Array | None, block_q: int, block_kv: int, axis='context') -> jax.Array:
    """Attention of queries whose sequence is split over mesh `axis` (context parallelism) over all keys.

    All-gather context parallelism (MaxText's `all-gather` strategy): each device keeps its
    queries and gathers every key and value (and their positions) over `axis`; the mask comes
    from positions, so any token order works (model/context.py). Memory per device: the local
    queries' scores against all T keys. `model/attention/ring.py`'s ring attention has this signature and
    replaces it outside pipelines (`across_context`): keys and values travel around the ring
    blockwise instead of being gathered.
    """
    del block_q, block_kv, axis  # the ring's; XLA places the gathers from the constraints
    k_bshk, v_bshk = (mesh_lib.constrain(x, ACT_BSHK_WHOLE) for x in (k_bthk, v_bthk))
    return reference_attention(q_bthk, k_bshk, v_bshk, positions_bt, segments_bt)


def dot_product_attention(q_bthk, k_bshk, v_bshk, impl: str, block_q: int = 64, block_kv: int = 64, *,
                          positions_bt: jax.Array | None = None, segments_bt: jax.Array | None = None) -> jax.Array:
    """Causal attention with the named kernel (see the module docstring); block sizes: blockwise only.

    With `positions_bt` / `segments_bt` [B, T] the mask is `visible`'s: by positions, within documents.
    """
    impl = resolve_impl(impl, q_bthk.dtype)
    if impl == 'reference':
        return saved.name_output(reference_attention(q_bthk, k_bshk, v_bshk, positions_bt, segments_bt))
    if impl == 'blockwise':
        return blockwise_attention(q_bthk, k_bshk, v_bshk, block_q, block_kv, positions_bt=positions_bt,
                                   segments_bt=segments_bt)
    if impl in ('xla', 'cudnn'):
        if positions_bt is None and segments_bt is None:
            o_bthk = jax.nn.dot_product_attention(q_bthk, k_bshk, v_bshk, is_causal=True, implementation=impl)
            return saved.name_output(o_bthk)
        # jax 0.10 takes a boolean mask for both: xla applies it to its T x S scores, cudnn turns
        # it into an additive [B, 1, T, S] bias (jax._src.cudnn combine_bias_and_mask). cuDNN's
        # own packed-segment layout (q_offsets) is not reachable through jax.nn.
        mask_b1ts = visible(q_bthk.shape[1], positions_bt, segments_bt)[:, None]
        o_bthk = jax.nn.dot_product_attention(q_bthk, k_bshk, v_bshk, mask=mask_b1ts, implementation=impl)
        return saved.name_output(o_bthk)
    raise ValueError(f'unknown attention implementation {impl!r}')


class Attention(nnx.Module):
    """Multi-head causal self-attention, Megatron-split by heads over the tensor axis.

    The QKV projection is column-parallel (heads sharded), the output projection row-parallel
    (its contraction over sharded heads ends in one all-reduce).
    """

    def __init__(self, d_model: int, num_heads: int, *, impl: str, init_std: float, out_std: float,
                 rngs: nnx.Rngs, blocks: tuple[int, int] = (64, 64), lora: Lora | None = None):
        head_dim = d_model // num_heads
        self.num_heads, self.impl = num_heads, impl
        self.blocks = blocks  # (block_q, block_kv) of the blockwise kernel
        self.w_qkv = param(rngs.params(), (d_model, 3, num_heads, head_dim),
                           ('embed', 'qkv', 'heads', 'head_dim'), init_std)
        self.b_qkv = param(None, (3, num_heads, head_dim), ('qkv', 'heads', 'head_dim'), 0.0)
        self.w_out = param(rngs.params(), (num_heads, head_dim, d_model), ('heads', 'head_dim', 'embed'), out_std)
        self.b_out = param(None, (d_model,), ('embed',), 0.0)
        for name in ('w_qkv', 'w_out'):  # LoRA adapters of the targeted ones (layers/linear.py)
            linear.adapt(self, name, lora, rngs)

    def __call__(self, x_nd: jax.Array, seq: int | Seq, cache: KVCache | None = None,
                 positions_bt: jax.Array | None = None, key: jax.Array | None = None
                 ) -> jax.Array | tuple[jax.Array, KVCache]:
        """Attention of `x_nd` ([B*T, d], T = seq's length); with `cache`, also the extended cache.

        Training passes no cache; decoding passes this layer's cache {'k', 'v'} [B, S, H, K]
        and the tokens' positions [B, T] (`attend`). `key`: LoRA adapters' dropout (training).
        """
        qkv_n3hk = linear.project(self, 'w_qkv', 'nd,dahk->nahk', x_nd, bias='b_qkv', key=key)
        n, _, h, k = qkv_n3hk.shape
        seq_len = as_seq(seq).length
        qkv_bt3hk = unflatten_tokens(qkv_n3hk, n // seq_len, seq_len)  # [B, T, 3, H, K]
        o_bthk, cache = attend(qkv_bt3hk[:, :, 0], qkv_bt3hk[:, :, 1], qkv_bt3hk[:, :, 2], self.impl, self.blocks,
                               cache, positions_bt, seq)
        o_nhk = flatten_tokens(o_bthk)  # [N, H, K]
        y_nd = linear.project(self, 'w_out', 'nhk,hkd->nd', o_nhk, bias='b_out', out_names=ACT_ND, key=key)
        return y_nd if cache is None else (y_nd, cache)
