"""The blockwise (flash-style) attention kernel against the reference, in the model and at scale.

Kernel inputs are [batch 2, sequence, heads 3, head dim 8] with sequences that are and are
not multiples of the blocks (4 and 8 rows, also mixed and coprime); fp32 tolerances allow
reduction-order differences only (rtol 1e-5 / atol 1e-6, as tests/model/test_model.py), and the
float64 numpy attention of test_model checks both kernels. Model-level checks use the tiny GPT
of test_model (sequence 16, blocks 4 x 8, so queries see up to four key blocks) and the
layouts of layout_check.py (sequence 24, blocks 8 x 16: the last key block is half padding).
Masked kernels (positions, segments: issue 24) take 21 shuffled tokens of packed documents
and are held against the reference kernel's mask, which test_sequence holds against documents
run alone. Memory scaling is held by XLA's compiled memory analysis, never by the clock.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfrontier import config as config_lib
from jaxfrontier.errors import ConfigError
from jaxfrontier.model import params as params_lib
from jaxfrontier.model import attention as attention_lib
from jaxfrontier.model.attention import blockwise
from layout_check import check_against_reference, make_config, run_layout
from layout_once import run_layout_once
from test_model import ATOL, RTOL, assert_trees_close, numpy_causal_attention, params_and_tokens, tiny_config


def qkv_do(seq, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(3), 4)
    return tuple(jax.random.normal(key, (2, seq, 3, 8), jnp.float32).astype(dtype) for key in keys)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def out_and_grads(impl, block_q, block_kv, q, k, v, do):
    fn = functools.partial(attention_lib.dot_product_attention, impl=impl, block_q=block_q, block_kv=block_kv)
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(do)


@pytest.mark.parametrize('seq,block_q,block_kv', [(16, 4, 4), (13, 4, 4), (16, 8, 4), (13, 4, 8), (20, 3, 7),
                                                  (5, 8, 8), (1, 4, 4)])
def test_blockwise_equals_reference_forward_and_backward(seq, block_q, block_kv):
    q, k, v, do = qkv_do(seq)
    ref_out, ref_grads = out_and_grads('reference', 0, 0, q, k, v, do)
    out, grads = out_and_grads('blockwise', block_q, block_kv, q, k, v, do)
    assert out.shape == q.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(out, numpy_causal_attention(q, k, v), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out, ref_out, rtol=RTOL, atol=ATOL)
    for name, g, g_ref in zip('qkv', grads, ref_grads):
        np.testing.assert_allclose(g, g_ref, rtol=RTOL, atol=ATOL, err_msg=f'd{name}')


def test_blockwise_bfloat16_matches_fp32_reference():
    q, k, v, do = qkv_do(13, jnp.bfloat16)
    ref_out, ref_grads = out_and_grads('reference', 0, 0, *(x.astype(jnp.float32) for x in (q, k, v, do)))
    out, grads = out_and_grads('blockwise', 4, 8, q, k, v, do)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    tol = dict(rtol=2e-2, atol=2e-2)  # bf16 inputs and outputs: 8 mantissa bits
    np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, **tol)
    for name, g, g_ref in zip('qkv', grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g, np.float32), g_ref, **tol, err_msg=f'd{name}')


def test_auto_picks_blockwise_off_nvidia():
    assert attention_lib.resolve_impl('auto', jnp.float32, backend='cpu') == 'blockwise'
    assert attention_lib.resolve_impl('auto', jnp.bfloat16, backend='rocm') == 'blockwise'


@pytest.mark.parametrize('field,value', [('attention_block_q', 0), ('attention_block_kv', -3)])
def test_bad_block_sizes_fail_validation(field, value):
    c = tiny_config(attention='blockwise', **{field: value})
    with pytest.raises(ConfigError, match=f'model.{field}'):
        config_lib.validate(c)


# --------------------------------------------------------------------------- grouped-query attention


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def grouped_out_and_grads(heads, block_q, block_kv, q, k, v, do, pos=None, seg=None):
    """blockwise with G kv heads unrepeated (the packed fast path, or the masked path's repeat)."""
    fn = functools.partial(blockwise.blockwise_attention, block_q=block_q, block_kv=block_kv, positions_bt=pos,
                           segments_bt=seg)
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(do)


@functools.partial(jax.jit, static_argnums=(0,))
def repeated_reference(heads, q, k, v, do, pos=None, seg=None):
    """The reference kernel on kv heads repeated to the query heads; gradients of the G kv heads."""
    def fn(q, k, v):
        return attention_lib.reference_attention(q, attention_lib.repeat_kv(k, heads), attention_lib.repeat_kv(v, heads),
                                                 pos, seg)
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(do)


@pytest.mark.parametrize('seq,heads,kv_heads,block_q,block_kv', [
    (16, 6, 2, 4, 4), (13, 6, 2, 4, 8), (20, 4, 1, 3, 7), (16, 8, 2, 8, 4), (5, 4, 2, 8, 8), (1, 4, 2, 4, 4)])
def test_grouped_blockwise_packs_groups_and_equals_repeated_reference(seq, heads, kv_heads, block_q, block_kv):
    """Each kv head's query heads packed into one block (no repeat): output, dq, and dk / dv summed
    over the group, against the reference on repeated kv heads; padded and multi-query cases."""
    keys = jax.random.split(jax.random.key(5), 4)
    q, do = (jax.random.normal(key, (2, seq, heads, 8)) for key in keys[:2])
    k, v = (jax.random.normal(key, (2, seq, kv_heads, 8)) for key in keys[2:])
    out, grads = grouped_out_and_grads(heads, block_q, block_kv, q, k, v, do)
    ref_out, ref_grads = repeated_reference(heads, q, k, v, do)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    np.testing.assert_allclose(out, ref_out, rtol=RTOL, atol=ATOL)
    for name, g, g_ref in zip('qkv', grads, ref_grads):
        np.testing.assert_allclose(g, g_ref, rtol=RTOL, atol=ATOL, err_msg=f'd{name}')


def test_grouped_blockwise_with_positions_repeats_and_equals_reference():
    keys = jax.random.split(jax.random.key(6), 4)
    q, do = (jax.random.normal(key, (2, 21, 6, 8)) for key in keys[:2])
    k, v = (jax.random.normal(key, (2, 21, 2, 8)) for key in keys[2:])
    pos, seg, _ = packed_ids(21)
    out, grads = grouped_out_and_grads(6, 4, 4, q, k, v, do, pos, seg)
    ref_out, ref_grads = repeated_reference(6, q, k, v, do, pos, seg)
    np.testing.assert_allclose(out, ref_out, rtol=RTOL, atol=ATOL)
    for name, g, g_ref in zip('qkv', grads, ref_grads):
        np.testing.assert_allclose(g, g_ref, rtol=RTOL, atol=ATOL, err_msg=f'd{name}')


def whiles_in_step(fn, policy, *args):
    """While loops in the lowered value and gradient of `fn` under remat `policy` ('no remat': none)."""
    if policy != 'no remat':
        fn = jax.checkpoint(fn, policy=policy)
    grad = jax.value_and_grad(fn, argnums=tuple(range(len(args))))
    return jax.jit(grad).lower(*args).as_text().count('stablehlo.while')


@pytest.mark.parametrize('masked,kv_heads', [(False, 4), (False, 2), (True, 4)])
def test_save_dots_attention_keeps_the_kernels_forward_out_of_the_backward(masked, kv_heads):
    """blockwise's forward rules name the output and logsumexp (`keep`): remat=save_dots_attention saves
    them, so value + gradient holds the forward's block loops once, as without remat; save_dots_no_batch
    (which saves only weight matmuls) runs them again in the backward. Plain, grouped and masked paths."""
    from jaxfrontier.model import stack
    keys = jax.random.split(jax.random.key(7), 2)
    q = jax.random.normal(keys[0], (2, 16, 4, 8))
    kv = jax.random.normal(keys[1], (2, 16, kv_heads, 8))
    w = jnp.eye(8) * 0.5
    pos, seg, _ = packed_ids(16) if masked else (None, None, None)

    def fn(q, kv):  # a weight matmul, then the kernel, then a non-linear loss: the output is needed
        q = jnp.tanh(q @ w)
        o = blockwise.blockwise_attention(q, kv, kv, 4, 4, positions_bt=pos, segments_bt=seg)
        return jnp.sin(o).sum()

    counts = {name: whiles_in_step(fn, policy, q, kv) for name, policy in (
        ('no remat', 'no remat'), ('kept', stack.REMAT_POLICIES['save_dots_attention']),
        ('recomputed', stack.REMAT_POLICIES['save_dots_no_batch']))}
    assert counts['kept'] == counts['no remat'] < counts['recomputed'], counts


def test_blockwise_refuses_kv_heads_that_do_not_divide_the_heads():
    q = jnp.zeros((1, 8, 6, 4))
    with pytest.raises(ValueError, match='G dividing H'):
        blockwise.blockwise_attention(q, jnp.zeros((1, 8, 4, 4)), jnp.zeros((1, 8, 4, 4)))


def test_attend_packs_groups_only_on_the_plain_causal_blockwise_path():
    """attend hands blockwise the kv heads unrepeated only where the packed kernel applies; the
    program then has no repeat of the keys (no [B, T, H, K] broadcast of them)."""
    seq_plain = attention_lib.as_seq(16)
    q, k = jnp.zeros((2, 16, 6, 8)), jnp.zeros((2, 16, 2, 8))
    assert attention_lib.grouped_blockwise('blockwise', q, k, seq_plain, None)
    assert attention_lib.grouped_blockwise('auto', q, k, seq_plain, None)  # the CPU's auto is blockwise
    assert not attention_lib.grouped_blockwise('reference', q, k, seq_plain, None)
    assert not attention_lib.grouped_blockwise('blockwise', q, q, seq_plain, None)  # G = H: nothing to pack
    assert not attention_lib.grouped_blockwise('blockwise', q, k, seq_plain, ('context',))
    pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
    assert not attention_lib.grouped_blockwise('blockwise', q, k, attention_lib.Seq(16, pos),
                                               None)

    def attend(q, k, v):
        return attention_lib.attend(q, k, v, 'blockwise', (4, 4))[0]
    kernels = [e for e in jax.make_jaxpr(attend)(q, k, k).eqns if 'custom_vjp' in e.primitive.name]
    assert [[v.aval.shape for v in e.invars] for e in kernels] == [[q.shape, k.shape, k.shape]]


# --------------------------------------------------------------------------- masked: positions, segments


def packed_ids(seq, seed=0):
    """Positions and segments [2, seq] of packed documents (positions restart per document), the
    tokens then shuffled (a token order nothing may assume sorted): row 0 has four documents,
    row 1 two, so the rows' masks differ."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((2, seq), np.int32)
    for row, docs in enumerate((4, 2)):
        for cut in sorted(rng.choice(np.arange(1, seq), docs - 1, replace=False)):
            seg[row, cut:] += 1
    pos = np.stack([np.concatenate([np.arange(n) for n in np.bincount(r)]) for r in seg]).astype(np.int32)
    order = rng.permutation(seq)
    return jnp.asarray(pos[:, order]), jnp.asarray(seg[:, order]), order


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def masked_out_and_grads(impl, block_q, block_kv, q, k, v, do, pos, seg):
    fn = functools.partial(attention_lib.dot_product_attention, impl=impl, block_q=block_q, block_kv=block_kv,
                           positions_bt=pos, segments_bt=seg)
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(do)


@pytest.mark.parametrize('impl,block_q,block_kv', [('blockwise', 4, 4), ('blockwise', 5, 3), ('xla', 0, 0)])
def test_masked_kernels_equal_reference_forward_and_backward(impl, block_q, block_kv):
    """Shuffled positions, several documents per row, blocks that do not divide 21."""
    pos, seg, order = packed_ids(21)
    q, k, v, do = (x[:, order] for x in qkv_do(21))
    ref_out, ref_grads = masked_out_and_grads('reference', 0, 0, q, k, v, do, pos, seg)
    out, grads = masked_out_and_grads(impl, block_q, block_kv, q, k, v, do, pos, seg)
    np.testing.assert_allclose(out, ref_out, rtol=RTOL, atol=ATOL)
    for name, g, g_ref in zip('qkv', grads, ref_grads):
        np.testing.assert_allclose(g, g_ref, rtol=RTOL, atol=ATOL, err_msg=f'd{name}')


def test_masked_blockwise_positions_alone_equal_reference():
    """Positions without segments (context parallelism's zigzag order of one document)."""
    order = np.concatenate([np.arange(0, 4), np.arange(12, 16), np.arange(4, 12)])
    pos = jnp.asarray(np.stack([order, order]), jnp.int32)
    q, k, v, do = qkv_do(16)
    ref_out, ref_grads = masked_out_and_grads('reference', 0, 0, q, k, v, do, pos, None)
    out, grads = masked_out_and_grads('blockwise', 4, 4, q, k, v, do, pos, None)
    np.testing.assert_allclose(out, ref_out, rtol=RTOL, atol=ATOL)
    for name, g, g_ref in zip('qkv', grads, ref_grads):
        np.testing.assert_allclose(g, g_ref, rtol=RTOL, atol=ATOL, err_msg=f'd{name}')


def test_queries_that_see_no_key_give_zero_not_nan():
    """A key chunk wholly after the queries (ring attention's skipped step): output 0, logsumexp
    the finite MASKED, zero gradients."""
    @jax.jit
    def forward_backward(q, k, v, do):
        q_pos = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
        o, lse = blockwise.masked_forward(q, k, v, q_pos, q_pos + 6, block_q=4, block_kv=4)
        grads = blockwise.masked_backward(q, k, v, do, lse, jnp.zeros(lse.shape), q_pos, q_pos + 6, block_q=4,
                                          block_kv=4)
        return o, lse, grads

    o, lse, grads = forward_backward(*qkv_do(6))
    assert np.all(np.asarray(o) == 0) and np.all(np.asarray(lse) == blockwise.MASKED)
    assert all(np.all(np.asarray(g) == 0) for g in grads)


def test_block_visits_skip_masked_pairs():
    """Plain positions: the masked kernel visits exactly the plain kernel's causal pairs; two
    documents of 8 tokens with blocks of 4: the two cross-document pairs below the diagonal go."""
    for seq, bq, bkv in ((16, 4, 4), (21, 5, 3), (13, 8, 4)):
        plain = np.broadcast_to(np.arange(seq), (2, seq))
        assert blockwise.executed_block_pairs(plain, plain, block_q=bq, block_kv=bkv) == \
            blockwise.visited_block_pairs(seq, bq, bkv)
    seg = np.repeat([[0, 1]], 8, axis=1).repeat(2, axis=0)  # [2, 16]: tokens 0-7 doc 0, 8-15 doc 1
    pos = np.tile(np.arange(8), (2, 2))
    visits = blockwise.block_visits(pos, pos, seg, seg, 4, 4, xp=np)
    np.testing.assert_array_equal(visits, [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]])


# --------------------------------------------------------------------------- in the model


@functools.lru_cache(maxsize=None)
def gpt_loss_and_grads(attention, remat, scan_unroll=1):
    c = tiny_config(attention=attention, remat=remat, scan_unroll=scan_unroll, attention_block_q=4,
                    attention_block_kv=8)
    model_def = params_lib.ModelDef.create(config_lib.model_shape(c))
    params, tokens = params_and_tokens()
    loss, grads = jax.jit(jax.value_and_grad(lambda p, t: model_def.bind(p).loss(t[:, :-1], t[:, 1:])))(params, tokens)
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.mark.parametrize('remat', [r if r == 'full' else pytest.param(r, marks=pytest.mark.slow)
                                   for r in config_lib.REMAT_POLICIES])
def test_gpt_with_blockwise_equals_reference_under_each_remat_policy(remat):
    ref_loss, ref_grads = gpt_loss_and_grads('reference', 'none')
    loss, grads = gpt_loss_and_grads('blockwise', remat)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_trees_close(grads, ref_grads)


@pytest.mark.slow
@pytest.mark.parametrize('remat', ['none', 'full'])
def test_gpt_with_blockwise_unrolled_equals_reference(remat):
    ref_loss, ref_grads = gpt_loss_and_grads('reference', 'none')
    loss, grads = gpt_loss_and_grads('blockwise', remat, scan_unroll=2)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_trees_close(grads, ref_grads)


def with_blocks(c, block_q=8, block_kv=16):
    c.model.update(attention_block_q=block_q, attention_block_kv=block_kv)
    config_lib.validate(c, config_lib.num_devices(c))
    return c


@pytest.fixture(scope='module')
def reference_run():
    return run_layout(make_config(attention='reference'))


@pytest.mark.slow
def test_training_with_blockwise_matches_reference(reference_run):
    """One device: the step-0 loss and gradients, and the parameters after 3 AdamW steps."""
    check_against_reference(run_layout_once(with_blocks(make_config(attention='blockwise'))), reference_run)


@pytest.mark.slow
def test_blockwise_with_tensor_2_matches_single_device(reference_run):
    c = with_blocks(make_config(data=2, fsdp=2, tensor=2, attention='blockwise'))
    check_against_reference(run_layout_once(c), reference_run)


@pytest.mark.slow
def test_blockwise_inside_pipeline_matches_single_device(reference_run):
    """Staggered 1F1B, P 2 x tensor 2, M 4: the kernel inside a stage's manual map, against the
    module's one-device run (M not a multiple of P: tests/pipeline/test_pipeline.py)."""
    c = with_blocks(make_config(pipeline=2, schedule='1f1b', accum=4, tensor=2, attention='blockwise'))
    check_against_reference(run_layout_once(c), reference_run)


# --------------------------------------------------------------------------- memory


def attention_temp_bytes(impl, seq, block=64, masked=False):
    """XLA's compiled temporary bytes of forward + backward of the attention core alone (`masked`:
    with positions and segments [1, seq])."""
    x = jax.ShapeDtypeStruct((1, seq, 2, 64), jnp.float32)
    ids = jax.ShapeDtypeStruct((1, seq), jnp.int32) if masked else None

    def fwd_bwd(q, k, v, do, pos, seg):
        fn = functools.partial(attention_lib.dot_product_attention, impl=impl, block_q=block, block_kv=block,
                               positions_bt=pos, segments_bt=seg)
        out, vjp = jax.vjp(fn, q, k, v)
        return vjp(do)

    return jax.jit(fwd_bwd).lower(x, x, x, x, ids, ids).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_blockwise_memory_grows_linearly_reference_quadratically():
    """Sequence 2k -> 4k -> 8k: blockwise's temporaries double (O(s): blocked copies of q, k, v,
    dO and the fp32 dQ buffer), the reference's quadruple (the s x s scores and probabilities)."""
    blockwise = [attention_temp_bytes('blockwise', s) for s in (2048, 4096, 8192)]
    reference = [attention_temp_bytes('reference', s) for s in (2048, 4096, 8192)]
    for small, large in zip(blockwise, blockwise[1:]):
        assert 1.8 < large / small < 2.3, blockwise
    for small, large in zip(reference, reference[1:]):
        assert 3.6 < large / small < 4.4, reference
    assert reference[-1] > 50 * blockwise[-1], (reference, blockwise)


@pytest.mark.slow
def test_masked_blockwise_memory_grows_linearly():
    """The masked path stays O(s) too: its id blocks are O(s) and its visit table [B, Nq, Nkv]
    bools is 64 x 64 smaller than the scores. 2k -> 4k -> 8k: temporaries about double."""
    masked = [attention_temp_bytes('blockwise', s, masked=True) for s in (2048, 4096, 8192)]
    for small, large in zip(masked, masked[1:]):
        assert 1.8 < large / small < 2.3, masked


# --------------------------------------------------------------------------- remat, unrolled


def lowered_barriers(remat, scan_unroll):
    c = tiny_config(remat=remat, scan_unroll=scan_unroll, attention='reference')
    model_def = params_lib.ModelDef.create(config_lib.model_shape(c))
    tokens = jax.ShapeDtypeStruct((BATCH_TOKENS, c.model.seq_len + 1), jnp.int32)
    grad = jax.jit(jax.grad(lambda p, t: model_def.bind(p).loss(t[:, :-1], t[:, 1:])))
    return grad.lower(model_def.abstract_params(), tokens).as_text().count('optimization_barrier')


BATCH_TOKENS = 3


def test_unrolled_remat_keeps_its_cse_barrier():
    """Issue 14, 6b: outside a scan, a checkpoint policy must carry prevent_cse's optimization
    barrier (one per layer), or XLA merges the recomputation into the forward pass; the rolled
    scan needs none. remat=full unrolled needs none either: its recomputation waits on the
    cotangent (stack.recompute_after_cotangent; the next test)."""
    assert lowered_barriers('save_dots', scan_unroll=1) == 0
    assert lowered_barriers('save_dots', scan_unroll=2) == 2
    assert lowered_barriers('full', scan_unroll=2) == 0
    assert lowered_barriers('none', scan_unroll=2) == 0


def gpt_compiled(remat, scan_unroll):
    c = tiny_config(remat=remat, scan_unroll=scan_unroll, attention='reference', num_layers=4, seq_len=64)
    model_def = params_lib.ModelDef.create(config_lib.model_shape(c))
    tokens = jax.ShapeDtypeStruct((8, 65), jnp.int32)
    grad = jax.jit(jax.grad(lambda p, t: model_def.bind(p).loss(t[:, :-1], t[:, 1:])))
    return grad.lower(model_def.abstract_params(), tokens).compile()


@pytest.mark.slow  # four compiles, two of them unrolled: ~30 s
def test_unrolled_remat_full_saves_memory():
    """Issue 14's first must-show: XLA's compiled temporary memory with remat=full is well below
    remat=none for the fully unrolled stack (GPU default) as for the rolled scan (CPU default).
    The optimized unrolled program keeps the recomputation (five more matmuls per layer: q/k/v,
    scores, context, out-projection, MLP in), and since it waits on the cotangent, no scheduler
    can run it in the forward pass. (With jax.checkpoint(prevent_cse=True) alone, XLA:CPU
    removed the barriers and ran it early: 15.3 MB both ways; now 5.2 against 15.3 MB, rolled
    3.9 against 21.6 MB.)"""
    unrolled = {remat: gpt_compiled(remat, 4) for remat in ('full', 'none')}
    if jax.default_backend() == 'cpu':  # a GPU's optimized program calls its GEMMs as custom calls
        dots = {remat: c.as_text().count(' dot(') for remat, c in unrolled.items()}
        assert dots['full'] == dots['none'] + 4 * 5, dots
    temp = {remat: c.memory_analysis().temp_size_in_bytes for remat, c in unrolled.items()}
    rolled = {remat: gpt_compiled(remat, 1).memory_analysis().temp_size_in_bytes for remat in ('full', 'none')}
    assert rolled['full'] < 0.5 * rolled['none'], rolled
    assert temp['full'] < 0.5 * temp['none'], temp
