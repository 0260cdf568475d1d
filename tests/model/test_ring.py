"""Ring attention (model/attention/ring.py) against the reference kernel on one device; the balanced order's work.

Inputs [batch 4, sequence 48, heads 6, head dim 8] (distinct sizes; heads divide tensor 2),
packed documents whose positions restart per document, in the natural or the balanced
(zigzag) token order; blocks 5 x 4, which divide neither a rank's 24 or 12 rows nor the
balanced order's chunks of 12 or 6. Tolerances as test_attention (fp32, reduction order only),
with the absolute part scaled by the tensor's largest value: |ring - reference| <= RTOL * |reference|
+ ATOL * max |reference|. Measured on context 2 x data 4: the ring's worst difference is 1.13e-6 in
dq (whose values reach 2.55), 0.95e-6 in dk and dv, 0.7e-6 in the output, the same with LLVM's
optimised and unoptimised CPU code (tests/conftest.py). That is fp32 rounding of O(1) values, and
it falls anywhere: where the exact value is 0 (the first token of a document sees one key, so its
dq vanishes) an unscaled atol 1e-6 held the rounding only by luck (-6.1e-7 there with optimised
code, -1.21e-6 without). A wrong mask, block or rotation is off by O(1).
Every multi-device layout compiles a sharded forward and backward: slow.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxfrontier.model import attention as attention_lib
from jaxfrontier.model.attention import ring
from jaxfrontier.model.sequence import balanced_order
from jaxfrontier.plan import hlo_collectives
from test_model import ATOL, RTOL

B, T, H, K = 4, 48, 6, 8
BLOCK_Q, BLOCK_KV = 5, 4


def packed(order, with_segments=True):
    """q, k, v, dO [B, T, H, K] and positions, segments [B, T] in token order `order`.

    Rows hold 1 to 4 documents (row 0 one: plain positions), positions restarting per document."""
    keys = jax.random.split(jax.random.key(7), 4)
    q, k, v, do = (jax.random.normal(key, (B, T, H, K), jnp.float32) for key in keys)
    seg = np.zeros((B, T), np.int32)
    for row, cuts in enumerate(([], [17], [5, 30], [11, 12, 40])):
        for cut in cuts:
            seg[row, cut:] += 1
    pos = np.stack([np.concatenate([np.arange(n) for n in np.bincount(r)]) for r in seg]).astype(np.int32)
    if not with_segments:
        seg, pos = None, np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    ids = (jnp.asarray(pos[:, order]), None if seg is None else jnp.asarray(seg[:, order]))
    return (q[:, order], k[:, order], v[:, order], do[:, order]), ids


@functools.partial(jax.jit, static_argnums=(0,))
def out_and_grads(attend, q, k, v, do, pos, seg):
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, pos, seg), q, k, v)
    return out, vjp(do)


def reference(q, k, v, pos, seg):
    return attention_lib.reference_attention(q, k, v, pos, seg)


def ring_attend(q, k, v, pos, seg):
    return ring.ring_attention(q, k, v, positions_bt=pos, segments_bt=seg, block_q=BLOCK_Q, block_kv=BLOCK_KV)


def assert_matches_reference(got, arrays, ids):
    want = out_and_grads(reference, *arrays, *ids)
    for name, g, g_ref in zip(('output', 'dq', 'dk', 'dv'), (got[0], *got[1]), (want[0], *want[1])):
        g_ref = np.asarray(g_ref)
        np.testing.assert_allclose(g, g_ref, rtol=RTOL, atol=ATOL * np.abs(g_ref).max(), err_msg=name)


def mesh_of(**axes):
    size = int(np.prod(list(axes.values())))
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes),
                         devices=jax.devices()[:size])


def run_sharded(mesh, spec_bthk, arrays, ids):
    """Ring attention's output and gradients under `mesh`, inputs laid out by `spec_bthk`."""
    with jax.set_mesh(mesh):
        arrays = [jax.device_put(x, NamedSharding(mesh, spec_bthk)) for x in arrays]
        ids = [None if x is None else jax.device_put(x, NamedSharding(mesh, P(*spec_bthk[:2]))) for x in ids]
        return out_and_grads(ring_attend, *arrays, *ids)


@pytest.mark.slow
@pytest.mark.parametrize('context,balanced', [(2, False), (4, True), (4, False)])
def test_ring_with_batch_over_data_equals_one_device(context, balanced):
    """Context 2 and 4 x data 4 and 2 (batch sharded automatically beside the manual ring)."""
    order = balanced_order(T, context) if balanced else np.arange(T)
    arrays, ids = packed(order)
    got = run_sharded(mesh_of(data=8 // context, context=context), P('data', 'context'), arrays, ids)
    assert_matches_reference(got, arrays, ids)


@pytest.mark.slow
def test_ring_with_heads_over_tensor_equals_one_device():
    """Context 4 x tensor 2 (heads sharded automatically), plain positions in the balanced order."""
    arrays, ids = packed(balanced_order(T, 4), with_segments=False)
    got = run_sharded(mesh_of(context=4, tensor=2), P(None, 'context', 'tensor'), arrays, ids)
    assert_matches_reference(got, arrays, ids)


@pytest.mark.slow
def test_ring_nested_in_a_pipeline_map_equals_one_device():
    """Inside a shard_map manual over pipeline and data (the pipeline's, reduce-once), context 2."""
    arrays, ids = packed(balanced_order(T, 2))
    mesh = mesh_of(pipeline=2, data=2, context=2)
    rows = P(('pipeline', 'data'))

    def per_replica(q, k, v, do, pos, seg):
        out, vjp = jax.vjp(lambda q, k, v: ring_attend(q, k, v, pos, seg), q, k, v)
        return out, vjp(do)

    with jax.set_mesh(mesh):
        run = jax.jit(jax.shard_map(per_replica, in_specs=rows, out_specs=rows, axis_names={'pipeline', 'data'},
                                    check_vma=False))
        got = run(*arrays, *ids)
    assert_matches_reference(got, arrays, ids)


@pytest.mark.slow
def test_ring_traffic_is_ring_send_bytes():
    """The compiled program's collectives (plan/hlo_collectives: bytes x executions, per device;
    the ids' all-gather and the k/v and dk/dv collective-permutes) are exactly what
    ring_send_bytes tells the planner, forward and backward, context 4.
    (At context 2 XLA merges the backward's first k/v hop with the forward's when both are in one
    program without rematerialisation: one hop less than counted.)"""
    context = 4
    mesh = mesh_of(context=context)
    x = jax.ShapeDtypeStruct((B, T, H, K), jnp.float32, sharding=NamedSharding(mesh, P(None, 'context')))
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=NamedSharding(mesh, P(None, 'context')))
    with jax.set_mesh(mesh):
        hlo = out_and_grads.lower(ring_attend, x, x, x, x, ids, ids).compile().as_text()
    found = hlo_collectives.collectives(hlo, {'context': context})
    sent = sum(c.total_bytes for c in found)
    want = ring.ring_send_bytes(B, T, H, K, 4, context, segments=True)
    assert sent == want['forward'] + want['backward'], (sent, want, found)


def test_balanced_order_evens_each_ranks_attention_work():
    """Executed block pairs per context rank (the masked kernel's own visit rule), causal, one
    document of 64 tokens, blocks of 4, context 4. Natural order: rank r's 16 queries see every
    key before them, 16 r + 10 pairs (10, 26, 42, 58: 5.8x from first to last). Balanced: 34
    each."""
    seq, context, block = 64, 4, 4
    natural = ring.ring_block_pairs(np.arange(seq)[None], None, context, block, block)
    balanced = ring.ring_block_pairs(balanced_order(seq, context)[None], None, context, block, block)
    np.testing.assert_array_equal(natural, [16 * r + 10 for r in range(context)])
    assert balanced.max() <= 1.1 * balanced.min(), f'balanced {balanced} vs natural {natural}'
    assert balanced.sum() == natural.sum()  # the same causal work, spread evenly


def test_balanced_order_gives_rank_r_chunks_r_and_its_mirror():
    order = balanced_order(16, 2)  # chunks of 4: rank 0 holds 0 and 3, rank 1 holds 1 and 2
    np.testing.assert_array_equal(order, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
    with pytest.raises(ValueError, match='2 x context'):
        balanced_order(18, 4)
