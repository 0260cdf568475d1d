"""The mixture-of-experts layer (model/layers/moe.py) against a dense per-token reference, on one device.

The reference takes every token through its k experts by a plain gather of their weights and an
einsum (no sort, no grouped matmul), routes with its own code, and drops in capacity mode by walking the
tokens in order with a counter per expert (numpy). Forward values, the aux entries and the gradients (of
a random projection of the output plus the loss terms, for every parameter and the input) agree in fp32.
Sizes are distinct primes where they can be (d 13, F 7, E 5, tokens 3 x 11) so a swapped axis fails.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxfrontier.families.moe import MoEShape
from jaxfrontier.model import sequence
from jaxfrontier.model.layers import moe as moe_lib

D, F, E, ROWS, T = 13, 7, 5, 3, 11
RTOL, ATOL = 1e-5, 1e-6


def make(s: MoEShape, seed=0, bias=None):
    """(apply(params, x, seq) -> (y, aux), params with the bias set where given, an input [ROWS*T, D])."""
    graphdef, state = nnx.split(moe_lib.MoE(D, s, init_std=0.5, out_std=0.3, rngs=nnx.Rngs(seed)))
    params = nnx.to_pure_dict(state)
    if bias is not None:
        params['router_bias'] = jnp.asarray(bias, jnp.float32)

    def apply(p, x, seq=T):
        bound = jax.tree.map(lambda a: a, state)
        nnx.replace_by_pure_dict(bound, p)
        return nnx.merge(graphdef, bound)(x, seq)

    x = jax.random.normal(jax.random.key(seed + 1), (ROWS * T, D), jnp.float32)
    return apply, params, x


# --------------------------------------------------------------------------- the dense reference


def reference(s: MoEShape, p, x_nd, keys=None):
    """(output, aux) of the layer by a per-token gather and einsum; `keys` [N] the token order (capacity)."""
    x = x_nd.astype(jnp.float32)
    logits = x @ p['w_router']
    if s.router == 'softmax':
        probs = jax.nn.softmax(logits, axis=-1)
        values = probs
    else:
        values = jax.nn.sigmoid(logits)
        probs = values / values.sum(-1, keepdims=True)
    select = values + (jax.lax.stop_gradient(p['router_bias']) if s.router_bias else 0.0)
    idx = jnp.argsort(-select, axis=-1, stable=True)[:, :s.top_k]  # ties: the lower expert first, as top_k
    w = jnp.take_along_axis(values, idx, axis=-1)
    if s.norm_topk:
        w = w / w.sum(-1, keepdims=True)
    w = w * s.routed_scale
    n, k = idx.shape
    counts = np.bincount(np.asarray(idx).ravel(), minlength=E).astype(np.float32)
    kept = np.ones((n, k), bool)
    if not s.dropless:
        capacity = s.capacity(n)
        taken = np.zeros(E, int)
        for t in np.argsort(np.asarray(keys), stable=True):  # tokens in order
            for j in range(k):
                e = int(idx[t, j])
                kept[t, j] = taken[e] < capacity
                taken[e] += 1
    w = w * jnp.asarray(kept, jnp.float32)
    gate = jnp.einsum('nd,nkdf->nkf', x, p['w_gate'][idx])
    up = jnp.einsum('nd,nkdf->nkf', x, p['w_up'][idx])
    out = jnp.einsum('nkf,nkfd->nkd', jax.nn.silu(gate) * up, p['w_down'][idx])
    y = jnp.einsum('nkd,nk->nd', out, w)
    if s.shared:
        sh = p['shared']
        y = y + (jax.nn.silu(x @ sh['w_gate']) * (x @ sh['w_up'])) @ sh['w_down']
    load = counts / (k * n)
    aux = {'moe_load': jnp.asarray(load), 'moe_load_max_over_mean': E * jnp.max(jnp.asarray(load)), 'moe_entropy': jnp.mean(-jnp.sum(probs * jnp.log(probs), -1)),
           'moe_dropped': jnp.float32((~kept).sum() / (k * n))}
    if s.lb_coef:
        aux['loss_lb'] = s.lb_coef * E * jnp.sum(jnp.asarray(load) * probs.mean(0))
    if s.z_coef:
        aux['loss_z'] = s.z_coef * jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)
    return y, aux


# --------------------------------------------------------------------------- the layer against it

BASE = MoEShape(experts=E, top_k=2, mlp_dim=F, lb_coef=0.01, z_coef=0.001)
CASES = {
    'softmax': dataclasses.replace(BASE, norm_topk=False),
    'softmax_renorm_shared': dataclasses.replace(BASE, norm_topk=True, shared=2),
    'sigmoid_bias_scale': dataclasses.replace(BASE, router='sigmoid', router_bias=True, routed_scale=2.5, top_k=3),
    'top1_no_losses': dataclasses.replace(BASE, top_k=1, lb_coef=0.0, z_coef=0.0),
    'capacity': dataclasses.replace(BASE, dropless=False, capacity_factor=0.6),
    'capacity_sigmoid_shared': dataclasses.replace(BASE, dropless=False, capacity_factor=0.9, router='sigmoid',
                                                   router_bias=True, shared=1),
}
BIAS = [0.3, -0.2, 0.0, 0.5, -0.4]  # moves the choice of the sigmoid router: the bias must count there


def objective(fn, cot):
    """A scalar of (y, aux): a random projection of y plus the loss terms (their gradients included)."""
    def f(*args):
        y, aux = fn(*args)
        return jnp.sum(y * cot) + sum(v for k, v in aux.items() if k.startswith('loss_')), (y, aux)
    return f


FAST = ('softmax_renorm_shared', 'capacity')  # the rest slow: each case compiles a layer and its gradient


@pytest.mark.parametrize('case', [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_layer_matches_the_dense_reference(case):
    s = CASES[case]
    apply, params, x = make(s, bias=BIAS if s.router_bias else None)
    keys = np.arange(ROWS * T)  # plain sequences: the flat order is the token order
    cot = jax.random.normal(jax.random.key(7), x.shape)
    layer = jax.jit(jax.value_and_grad(objective(apply, cot), argnums=(0, 1), has_aux=True))
    ref = jax.value_and_grad(objective(lambda p, xx: reference(s, p, xx, keys), cot), argnums=(0, 1), has_aux=True)
    (value, (y, aux)), grads = layer(params, x)
    (ref_value, (ref_y, ref_aux)), ref_grads = ref(params, x)
    np.testing.assert_allclose(y, ref_y, rtol=RTOL, atol=ATOL)
    # The value sums ~430 products of O(1) terms that cancel to ~0.1: its rounding is absolute, ~1e-7 each.
    np.testing.assert_allclose(value, ref_value, rtol=RTOL, atol=2e-5)
    assert sorted(aux) == sorted(ref_aux)
    for name in aux:
        np.testing.assert_allclose(aux[name], ref_aux[name], rtol=RTOL, atol=ATOL, err_msg=name)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), grads, ref_grads)
    if s.router_bias:  # the bias only chooses: no gradient, and the optimizer leaves it alone
        assert float(np.max(np.abs(grads[0]['router_bias']))) == 0.0
    if not s.dropless:
        assert 0.05 < float(aux['moe_dropped']) < 0.6, float(aux['moe_dropped'])  # drops happen, counted exactly


@pytest.mark.slow
def test_capacity_follows_the_token_order_not_the_flat_order():
    """Context parallelism's flat order [C, B, T/C] with the zigzag positions (and packed documents): the
    same assignments are dropped as in row-major order, by the (row, document, position) keys."""
    s = CASES['capacity']
    apply, params, x = make(s)
    # A layout's flat order: context 2, zigzag: the permutation of 0..T-1 as positions (T = 11 is odd: use 12).
    t = 12
    x = jax.random.normal(jax.random.key(5), (2 * t, D), jnp.float32)
    order = sequence.balanced_order(t, 2)  # the columns each position of the permuted row holds
    perm_bt = jnp.broadcast_to(jnp.asarray(order, jnp.int32), (2, t))
    # x in natural order [B, T]; the layout holds x_bt[:, order], flattened [C, B, T/C]
    x_bt = x.reshape(2, t, D)
    permuted = x_bt[:, order]
    flat = jnp.swapaxes(permuted.reshape(2, 2, t // 2, D), 0, 1).reshape(2 * t, D)
    seq = sequence.Seq(t, perm_bt)
    # flatten_tokens needs the context parts under active rules; outside a mesh it is [B, T]: emulate by
    # giving the layer the [B, T]-flattened permuted rows (the keys then come from the positions alone).
    y_perm, aux = jax.jit(apply, static_argnums=())(params, permuted.reshape(2 * t, D), seq)
    y_ref, aux_ref = reference(s, params, x, np.arange(2 * t))
    y_back = jnp.zeros_like(x_bt).at[:, order].set(y_perm.reshape(2, t, D)).reshape(2 * t, D)
    np.testing.assert_allclose(y_back, y_ref, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(aux['moe_dropped'], aux_ref['moe_dropped'], rtol=RTOL)
    del flat


def test_token_keys_of_packed_documents_order_like_the_row():
    """Packed documents: (document, position) in a row sorts as the row's columns do."""
    segments = jnp.asarray([[0, 0, 0, 1, 1, 2, 2, 2]], jnp.int32)
    positions = jnp.asarray([[0, 1, 2, 0, 1, 0, 1, 2]], jnp.int32)
    perm = np.array([0, 7, 1, 6, 2, 5, 3, 4])  # a permuted layout of the row's 8 tokens
    keys = moe_lib.token_keys(sequence.Seq(8, positions[:, perm], segments[:, perm]), 8)
    ranks = np.lexsort(np.asarray(keys)[:, ::-1].T)
    np.testing.assert_array_equal(perm[ranks], np.arange(8))


def test_router_bias_update_moves_against_the_load():
    """b_i += rate x sign(mean load - load_i): underloaded experts up, overloaded down, per layer."""
    params = {'blocks': {'mlp': {'router_bias': jnp.zeros((2, 4))}, 'attn': {}}, 'wte': jnp.zeros(3)}
    load = jnp.asarray([[0.5, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.25]])
    out = moe_lib.update_router_bias(params, load, 0.1, ('blocks',))
    np.testing.assert_allclose(out['blocks']['mlp']['router_bias'], [[-0.1, 0.0, 0.0, 0.1], [0, 0, 0, 0]])
    assert out['wte'] is params['wte']


@pytest.mark.parametrize('fields,mesh,match', [
    (dict(moe_experts=4, moe_top_k=5), {}, r'model.moe_top_k = 5: each token chooses k of'),
    (dict(moe_experts=6), {'expert': 4}, r'mesh.expert = 4: must divide the model\'s 6 experts'),
    (dict(moe_experts=4, moe_dropless=False, moe_capacity_factor=0.0), {}, r'model.moe_capacity_factor = 0.0'),
    (dict(), {'expert': 2}, r'mesh.expert = 2: splits the experts of a mixture-of-experts model'),
])
def test_bad_moe_config_is_one_line(fields, mesh, match):
    """Top-k above the expert count, an expert axis that does not divide the experts or with no experts,
    a capacity factor <= 0: one ConfigError line naming the field (config.validate, before anything runs)."""
    from jaxfrontier import config as config_lib
    from jaxfrontier.errors import ConfigError
    c = config_lib.base_config()
    c.model.update(family='llama', **fields)
    c.mesh.update(**mesh)
    c.train.global_batch = 8
    with pytest.raises(ConfigError, match=match) as err:
        config_lib.validate(c)
    assert '\n' not in str(err.value)


def test_empty_expert_warning_once_per_stretch():
    """run/observe/experts.py: one line when an expert's load stays 0 for N steps, again after it revives."""
    from jaxfrontier.run.observe.experts import EmptyExperts
    watch, row = EmptyExperts(3), lambda loads: {'aux/moe_load/layers': [loads]}
    lines = [watch.observe(step, row([0.5, 0.0])) for step in range(5)]
    assert [len(x) for x in lines] == [0, 0, 1, 0, 0] and 'layer 0 expert 1' in lines[2][0]
    assert watch.observe(5, row([0.5, 0.5])) == [] and watch.observe(6, row([1.0, 0.0])) == []
    assert EmptyExperts(0).observe(9, row([1.0, 0.0])) == []
