"""The GPT's kernels and numerics against plain references.

Sizes are distinct so that a swapped axis fails: attention kernels get q/k/v of shape
[batch 2, sequence 12, heads 3, head dim 8]; the tiny GPT has batch 3, sequence 16, model 48,
4 heads of 12, MLP 192 and a vocabulary of 250 padded to 256. Everything is fp32 unless a test
is about bf16; fp32 tolerances allow reduction-order differences only (rtol 1e-5 / atol 1e-6):
a wrong mask, scale or axis is off by orders of magnitude. Remat policies must agree bitwise.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.training import step as step_lib
from jaxfrontier.training import state as ts
from jaxfrontier.model import attention as attention_lib
from jaxfrontier.model.layers import cross_entropy, dropout, embedding_lookup
from jaxfrontier.model import params as params_lib
from jaxfrontier.model import stack

RTOL, ATOL = 1e-5, 1e-6
BATCH, SEQ = 3, 16


def tiny_config(**model):
    c = config_lib.base_config()
    c.model.update(num_layers=2, d_model=48, num_heads=4, seq_len=SEQ, vocab_size=250, vocab_multiple=128,
                   dtype='float32', remat='none', attention='xla', tied_embeddings=True)
    c.model.update(**model)
    return c


@functools.lru_cache(maxsize=None)
def params_and_tokens():
    """Random fp32 params of the tiny model (shared by every kernel, policy and dtype), and a batch.

    Drawn with numpy rather than the model's init: no compile, and non-zero biases and
    LayerNorm offsets, so every parameter's path through the model is exercised.
    """
    abstract = params_lib.ModelDef.create(config_lib.model_shape(tiny_config())).abstract_params()
    rng = np.random.default_rng(0)

    def draw(path, x):
        noise = rng.normal(0.0, 0.1, x.shape).astype(np.float32)
        return noise + np.float32(1.0) if str(path[-1].key) == 'scale' else noise

    params = jax.tree_util.tree_map_with_path(draw, abstract)
    tokens = rng.integers(0, 250, (BATCH, SEQ + 1), dtype=np.int32)
    return params, tokens


def gpt_loss_and_grads(attention='xla', remat='none', dropout_rate=0.0, scan_unroll=1):
    """(loss, grads) of the tiny GPT on one device for these model settings, as numpy."""
    return _gpt_loss_and_grads(attention, remat, dropout_rate, scan_unroll)  # one compile per setting


@functools.lru_cache(maxsize=None)
def _gpt_loss_and_grads(attention, remat, dropout_rate, scan_unroll):
    c = tiny_config(attention=attention, remat=remat, dropout_rate=dropout_rate, scan_unroll=scan_unroll)
    model_def = params_lib.ModelDef.create(config_lib.model_shape(c))
    params, tokens = params_and_tokens()

    def loss_fn(p, t):
        return model_def.bind(p).loss(t[:, :-1], t[:, 1:])

    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, tokens)
    assert loss.dtype == jnp.float32
    return float(loss), jax.tree.map(np.asarray, grads)


def assert_trees_close(actual, expected, rtol=RTOL, atol=ATOL, what='grad'):
    flat_a = jax.tree_util.tree_leaves_with_path(actual)
    flat_e = jax.tree.leaves(expected)
    assert len(flat_a) == len(flat_e)
    for (path, a), e in zip(flat_a, flat_e):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f'{what} {jax.tree_util.keystr(path)}')


# --------------------------------------------------------------------------- (a) attention kernels


def qkv(dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(1), 4)
    q, k, v, dout = (jax.random.normal(key, (2, 12, 3, 8), jnp.float32).astype(dtype) for key in keys)
    return q, k, v, dout


@functools.partial(jax.jit, static_argnums=0)
def attention_and_grads(impl, q, k, v, dout):
    out, vjp = jax.vjp(lambda q, k, v: attention_lib.dot_product_attention(q, k, v, impl), q, k, v)
    return out, vjp(dout)


def numpy_causal_attention(q, k, v):
    """Plain float64 causal attention: the reference of the references."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum('bthk,bshk->bhts', q, k) / np.sqrt(q.shape[-1])
    t = q.shape[1]
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum('bhts,bshk->bthk', p, v)


def test_reference_and_xla_attention_agree():
    q, k, v, dout = qkv()
    ref_out, ref_grads = attention_and_grads('reference', q, k, v, dout)
    xla_out, xla_grads = attention_and_grads('xla', q, k, v, dout)
    assert ref_out.shape == (2, 12, 3, 8) and ref_out.dtype == jnp.float32
    np.testing.assert_allclose(ref_out, numpy_causal_attention(q, k, v), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(xla_out, ref_out, rtol=RTOL, atol=ATOL)
    for name, g_xla, g_ref in zip('qkv', xla_grads, ref_grads):
        np.testing.assert_allclose(g_xla, g_ref, rtol=RTOL, atol=ATOL, err_msg=f'd{name}')
    # causal: the first position attends only to itself
    np.testing.assert_allclose(ref_out[:, 0], v[:, 0], rtol=RTOL, atol=ATOL)


@pytest.mark.slow  # the fast tier: test_reference_and_xla_attention_agree, and test_attention's kernels vs reference forward and backward
def test_gpt_loss_and_grads_same_with_reference_and_xla_attention():
    ref_loss, ref_grads = gpt_loss_and_grads(attention='reference')
    xla_loss, xla_grads = gpt_loss_and_grads(attention='xla')
    np.testing.assert_allclose(xla_loss, ref_loss, rtol=1e-6)
    assert_trees_close(xla_grads, ref_grads)


def test_auto_attention_dispatch_by_backend():
    assert attention_lib.resolve_impl('auto', jnp.bfloat16, backend='cpu') == 'blockwise'
    assert attention_lib.resolve_impl('auto', jnp.float32, backend='cpu') == 'blockwise'
    assert attention_lib.resolve_impl('auto', jnp.bfloat16, backend='rocm') == 'blockwise'  # FRONTIER.md: no Pallas
    assert attention_lib.resolve_impl('reference', jnp.bfloat16, backend='cpu') == 'reference'


def test_cudnn_attention_matches_reference():
    if jax.default_backend() != 'gpu' or 'nvidia' not in jax.devices()[0].device_kind.lower():
        pytest.skip('cuDNN attention needs an NVIDIA GPU')
    q, k, v, dout = qkv(jnp.bfloat16)
    ref_out, ref_grads = attention_and_grads('reference', *(x.astype(jnp.float32) for x in (q, k, v, dout)))
    out, grads = attention_and_grads('cudnn', q, k, v, dout)
    tol = dict(rtol=2e-2, atol=2e-2)  # bf16 inputs and outputs: 8 mantissa bits
    np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, **tol)
    for name, g, g_ref in zip('qkv', grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g, np.float32), g_ref, **tol, err_msg=f'd{name}')


# --------------------------------------------------------------------------- (b) remat policies


def check_remat_policy(remat, **model):
    """`remat` against remat=none for the tiny GPT with these model settings (gpt_loss_and_grads')."""
    ref_loss, ref_grads = gpt_loss_and_grads(remat='none', **model)
    loss, grads = gpt_loss_and_grads(remat=remat, **model)
    # Recomputation runs the same ops on the same values: bitwise the same result on one device.
    assert loss == ref_loss
    for (path, g), g_ref in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_array_equal(g, g_ref, err_msg=f'grad {jax.tree_util.keystr(path)}')


@pytest.mark.slow  # the fast tier: test_attention's blockwise kernel under remat=full equals the reference
def test_full_remat_does_not_change_loss_or_grads():
    check_remat_policy('full')


@pytest.mark.slow
@pytest.mark.parametrize('remat', ['save_dots', 'save_dots_no_batch'])
def test_remat_policy_does_not_change_loss_or_grads_slow(remat):
    check_remat_policy(remat)


@pytest.mark.parametrize('unroll', [1, 2])  # rolled scan; every layer unrolled (the checkpoint's barriers)
def test_save_dots_attention_does_not_change_loss_or_grads(unroll):
    """The CPU's fastest policy (docs/PERFORMANCE.md) with the CPU's kernel, blockwise: the same ops on
    the same values as remat=none, bitwise, whether it saves (its output, statistics, matmuls) or
    recomputes (norms, activations)."""
    check_remat_policy('save_dots_attention', attention='blockwise', scan_unroll=unroll)


@pytest.mark.parametrize('unroll', [2, 3])  # 2 = fully unrolled (a plain loop), 3 > layers
def test_unrolled_layers_match_the_scan(unroll):
    ref_loss, ref_grads = gpt_loss_and_grads(remat='full')
    loss, grads = gpt_loss_and_grads(remat='full', scan_unroll=unroll)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # three compiles of a five-layer model with its gradients
def test_grouped_scan_matches_the_rolled_scan_and_compiles_its_layer_bodies():
    """model.scan_unroll=k between 1 and the layer count is a scan over groups of k layers, the
    remainder unrolled after it: the same loss and gradients as the rolled scan (remat=full), and
    a compiled program whose dot count grows by one layer's dots per copy that
    stack.layer_bodies counts (what plan/compile_time.py charges compile time for)."""
    layers, rng = 5, np.random.default_rng(3)
    tokens = rng.integers(0, 250, (BATCH, SEQ + 1), dtype=np.int32)
    results = {}
    for unroll in (1, 2, 4):  # 1, 2 + 2 + 1 and 4 + 1 layers per program: 1, 3 and 5 copies
        c = tiny_config(num_layers=layers, d_model=24, num_heads=2, remat='full', scan_unroll=unroll)
        model_def = params_lib.ModelDef.create(config_lib.model_shape(c))
        if unroll == 1:
            params = jax.tree.map(lambda a: rng.normal(0.0, 0.1, a.shape).astype(np.float32),
                                  model_def.abstract_params())
        step = jax.jit(jax.value_and_grad(lambda p, t: model_def.bind(p).loss(t[:, :-1], t[:, 1:])))
        compiled = step.lower(params, tokens).compile()
        dots = len(re.findall(r' dot\(', compiled.as_text()))
        results[unroll] = stack.layer_bodies(layers, unroll), dots, compiled(params, tokens)
    (_, dots_1, (ref_loss, ref_grads)), per_copy = results[1], (results[2][1] - results[1][1]) / 2
    assert per_copy >= 6  # a layer's forward has 6 matmuls, its backward more
    for unroll in (2, 4):
        bodies, dots, (loss, grads) = results[unroll]
        assert dots == dots_1 + per_copy * (bodies - 1), (unroll, bodies, dots)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
        assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # two compiles with dropout: ~25 s
def test_unrolled_remat_full_with_dropout_matches_the_scan():
    """The unrolled remat=full recomputes each layer in its own backward (recompute_after_cotangent,
    a custom VJP): it must redraw the same dropout masks as the forward and as the scan."""
    c = tiny_config(dropout_rate=0.2, remat='full')

    def loss_and_grads(scan_unroll):
        c.model.scan_unroll = scan_unroll
        model_def = params_lib.ModelDef.create(config_lib.model_shape(c))
        params, tokens = params_and_tokens()
        fn = jax.jit(jax.value_and_grad(lambda p, t: model_def.bind(p).loss(t[:, :-1], t[:, 1:], jax.random.key(7))))
        return fn(params, tokens)

    (ref_loss, ref_grads), (loss, grads) = loss_and_grads(1), loss_and_grads(2)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    no_dropout, _ = gpt_loss_and_grads(remat='full')
    assert abs(float(loss) - no_dropout) > 1e-4  # dropout is on
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- (c) dropout


def test_dropout_identity_without_rate_or_key():
    x = jax.random.normal(jax.random.key(2), (64, 48))
    assert dropout(x, 0.0, jax.random.key(3)) is x
    assert dropout(x, 0.5, None) is x


def test_dropout_keeps_expectation():
    rate = 0.25
    x = jnp.ones((128, 96), jnp.float32)
    y = np.asarray(dropout(x, rate, jax.random.key(4)))
    kept = y != 0
    np.testing.assert_array_equal(y[kept], np.float32(1.0) / np.float32(1 - rate))  # scale 1 / (1 - rate)
    assert abs(kept.mean() - (1 - rate)) < 0.02  # 4.4 sigma for 12,288 draws
    assert abs(y.mean() - 1.0) < 0.03  # unbiased: E[dropout(x)] = x
    np.testing.assert_array_equal(y, np.asarray(dropout(x, rate, jax.random.key(4))))  # deterministic
    assert not np.array_equal(y, np.asarray(dropout(x, rate, jax.random.key(5))))
    assert dropout(x.astype(jnp.bfloat16), rate, jax.random.key(4)).dtype == jnp.bfloat16


def test_gpt_dropout_depends_on_key_only():
    c = tiny_config(dropout_rate=0.2)
    model_def = params_lib.ModelDef.create(config_lib.model_shape(c))
    params, tokens = params_and_tokens()
    loss_fn = jax.jit(lambda p, t, key: model_def.bind(p).loss(t[:, :-1], t[:, 1:], key))
    loss_a, loss_a2, loss_b = (float(loss_fn(params, tokens, jax.random.key(s))) for s in (7, 7, 8))
    no_dropout, _ = gpt_loss_and_grads(attention='xla')
    eval_loss = float(jax.jit(lambda p, t: model_def.bind(p).loss(t[:, :-1], t[:, 1:]))(params, tokens))
    np.testing.assert_allclose(eval_loss, no_dropout, rtol=1e-6)  # key None: no dropout
    assert loss_a == loss_a2
    assert loss_a != loss_b and abs(loss_a - no_dropout) > 1e-4


# --------------------------------------------------------------------------- (d) padded cross-entropy


def test_cross_entropy_ignores_vocabulary_padding():
    n, real, padded = 10, 11, 16
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(n, padded)).astype(np.float32)
    logits[:, real:] = rng.uniform(5, 10, size=(n, padded - real))  # large: any leak shows
    targets = rng.integers(0, real, n).astype(np.int32)
    targets[0] = real - 1  # the last real entry, next to the padding

    # plain log-softmax over the unpadded logits, in float64
    z = logits[:, :real].astype(np.float64)
    log_p = z - z.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    expected = -log_p[np.arange(n), targets].mean()
    expected_grad = np.exp(log_p)
    expected_grad[np.arange(n), targets] -= 1
    expected_grad /= n

    loss_and_grad = jax.jit(jax.value_and_grad(cross_entropy), static_argnums=2)
    loss, grad = loss_and_grad(jnp.asarray(logits), jnp.asarray(targets), real)
    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(loss, expected, rtol=RTOL)
    np.testing.assert_allclose(grad[:, :real], expected_grad, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(grad[:, real:], 0.0)
    unpadded = cross_entropy(jnp.asarray(logits[:, :real]), jnp.asarray(targets), real)
    np.testing.assert_allclose(loss, unpadded, rtol=RTOL)
    bf16 = cross_entropy(jnp.asarray(logits, jnp.bfloat16), jnp.asarray(targets), real)
    assert bf16.dtype == jnp.float32


# --------------------------------------------------------------------------- (e) vocabulary-parallel head

COLLECTIVES = ('all-gather', 'all-reduce', 'all-to-all', 'reduce-scatter', 'collective-permute')


def collectives_with_dims(hlo: str, must_have: tuple[int, ...], any_of: tuple[tuple[int, ...], ...]) -> list[str]:
    """HLO lines of collectives whose result has dims `must_have` and one group of `any_of`."""
    found = []
    for line in hlo.splitlines():
        match = re.search(r'=\s*(.*?)\s(%s)(-start)?\(' % '|'.join(COLLECTIVES), line)
        if not match:
            continue
        for dims in re.findall(r'\[([\d,]*)\]', match.group(1)):
            dims = {int(d) for d in dims.split(',') if d}
            if set(must_have) <= dims and any(set(group) <= dims for group in any_of):
                found.append(line.strip())
    return found


def test_logits_detector_sees_a_gathered_logits_array():
    """Control: gathering vocabulary-sharded [N, V] logits is what the detector reports."""
    mesh = mesh_lib.make_mesh({'pipeline': 1, 'data': 1, 'fsdp': 1, 'tensor': 8})
    x = jax.ShapeDtypeStruct((96, 512), jnp.float32, sharding=NamedSharding(mesh, P(None, 'tensor')))
    fn = jax.jit(lambda x: jnp.exp(x) + 1, out_shardings=NamedSharding(mesh, P()))
    hlo = fn.lower(x).compile().as_text()
    assert collectives_with_dims(hlo, (512,), ((96,),))


def test_vocab_parallel_loss_never_gathers_logits():
    # 8 heads over tensor 8; vocabulary 500 padded to 512 (64 per shard); N = 4 x 24 = 96 tokens.
    c = tiny_config(num_heads=8, d_model=48, vocab_size=500, vocab_multiple=8, seq_len=24)
    c.mesh.tensor = 8
    c.train.update(global_batch=4, micro_batch=4, accum_steps=1)
    config_lib.validate(c, 8)
    v, n = config_lib.padded_vocab(c), 4 * 24
    assert v == 512
    mesh = mesh_lib.mesh_from_config(c)
    layout = ts.make_placement(c, mesh)
    batch_sharding = NamedSharding(mesh, mesh_lib.batch_spec(layout.rules))
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          layout.abstract_state['params'], layout.param_shardings)
    batch = jax.ShapeDtypeStruct((4, 25), jnp.int32, sharding=batch_sharding)
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        fn = jax.jit(step_lib.make_loss_and_grads(c, layout))
        hlo = fn.lower(params, batch, 0).compile().as_text()
    gathered = collectives_with_dims(hlo, (v,), ((n,), (4, 24)))
    assert not gathered, '\n'.join(gathered)
    # The logits are computed, as per-shard [N, V / 8] blocks of the head's einsum.
    logits = [line for line in hlo.splitlines()
              if re.search(r'= f32\[%d,%d\]\{[\d,]*\} [\w-]+\(' % (n, v // 8), line) and 'nd,vd->nv' in line]
    assert logits, 'no per-shard logits [N, V/8] from the head einsum in the HLO'
    assert not re.search(r'= f32\[%d,%d\]' % (n, v), hlo), 'full logits [N, V] materialised on a device'


# --------------------------------------------------------------------------- (f) embedding lookup


@pytest.mark.parametrize('shape', [dict(tensor=8), dict(data=2, fsdp=2, tensor=2)], ids=['t8', 'd2f2t2'])
def test_vocab_parallel_embedding_lookup_matches_take(shape):
    v, d, b, t = 40, 10, 4, 12
    rng = np.random.default_rng(5)
    table = rng.normal(size=(v, d)).astype(np.float32)
    ids = np.concatenate([rng.permutation(v), rng.integers(0, v, b * t - v)]).reshape(b, t).astype(np.int32)
    dout = rng.normal(size=(b, t, d)).astype(np.float32)
    expected_grad = np.zeros_like(table)
    np.add.at(expected_grad, ids, dout)  # repeated ids accumulate

    sizes = {'pipeline': 1, 'data': 1, 'fsdp': 1, 'tensor': 1, **shape}
    mesh = mesh_lib.make_mesh(sizes)
    rules = config_lib.resolve_rules(config_lib.DEFAULT_RULES, config_lib.model_shape(config_lib.base_config()), sizes)
    table_sharding = NamedSharding(mesh, mesh_lib.logical_to_spec(('vocab', 'embed'), rules))
    ids_sharding = NamedSharding(mesh, mesh_lib.batch_spec(rules))

    def lookup_and_grad(table_vd, ids_bt, dout_btd):
        assert mesh_lib.active_axes('vocab') == ('tensor',)  # the shard_map path, not jnp.take
        out, vjp = jax.vjp(lambda w: embedding_lookup(w, ids_bt), table_vd)
        return out, vjp(dout_btd)[0]

    with jax.set_mesh(mesh), mesh_lib.use_rules(rules):
        out, grad = jax.jit(lookup_and_grad, in_shardings=(table_sharding, ids_sharding, None))(table, ids, dout)
    np.testing.assert_array_equal(out, np.asarray(jnp.take(table, ids, axis=0)))
    np.testing.assert_allclose(grad, expected_grad, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- (g) bf16 compute


def test_bf16_compute_keeps_fp32_params_and_loss():
    c = tiny_config(dtype='bfloat16')
    model_def = params_lib.ModelDef.create(config_lib.model_shape(c))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(model_def.abstract_params()))
    params, tokens = params_and_tokens()

    def loss_fn(p, t):
        model = model_def.bind(p)
        x_nd = model.embed(t[:, :-1])
        assert x_nd.dtype == jnp.bfloat16  # activations in the compute dtype
        assert model.logits(x_nd).dtype == jnp.float32
        return model.loss(t[:, :-1], t[:, 1:])

    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, tokens)
    assert loss.dtype == jnp.float32
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    fp32_loss, _ = gpt_loss_and_grads(attention='xla')
    np.testing.assert_allclose(float(loss), fp32_loss, rtol=1e-2)  # bf16 rounding, same model
    assert float(loss) != fp32_loss  # it did compute in bf16
