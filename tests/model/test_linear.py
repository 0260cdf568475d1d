"""The one matmul seam (model/layers/linear.py): every weight matmul of every family goes through it.

Each family's loss is traced (jax.make_jaxpr, nothing compiled) with the seam wrapped in a named
scope; every dot_general with an operand that is a parameter (followed through casts, reshapes,
slices, and into scans, remat, calls and conditionals) must lie inside that scope, so a weight
matmul written by hand fails here. The weights multiply in the compute dtype (the dtype policy),
and the block parameters the seam reads are exactly those the pipeline casts ahead by name
(CAST_PREFIXES). Sizes are distinct primes where they can be, so a weight is never mistaken for an activation.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jex_core

from jaxfrontier import config as config_lib
from jaxfrontier.model import params as params_lib
from jaxfrontier.model.decoder import Decoder
from jaxfrontier.model.layers import linear, mlp

SEAM = 'matmul_seam'
BATCH = 3
# Primitives that hand a parameter on unchanged in value (a cast, a view, a slice): their output is
# still "the weight" when their first operand is.
PASS_THROUGH = {'convert_element_type', 'reshape', 'transpose', 'squeeze', 'expand_dims', 'broadcast_in_dim',
                'copy', 'copy_p', 'sharding_constraint', 'slice', 'dynamic_slice', 'reduce_precision', 'mesh_cast'}

GPT = dict(family='gpt', num_layers=2, d_model=40, num_heads=4, seq_len=13, vocab_size=251, vocab_multiple=1,
           mlp_dim=68, attention='reference')
LLAMA = dict(family='llama', num_layers=2, d_model=40, num_heads=4, num_kv_heads=2, qkv_bias=True, seq_len=13,
             vocab_size=251, vocab_multiple=1, mlp_dim=68, attention='reference')
# Llama with mixture-of-experts layers (model/layers/moe.py): a dense first layer (a stem group), then MoE
# layers with shared experts.
LLAMA_MOE = dict(LLAMA, num_layers=3, moe_experts=5, moe_top_k=2, moe_mlp_dim=17, moe_shared_experts=1,
                 moe_first_dense=1, moe_router='sigmoid', moe_router_bias=True)
# Weight matmuls of one block and the head, per family: GPT's fused QKV, attention out, MLP in and
# out; Llama's q, kv, out, gate, up, down; each family's logits (head, or the tied embedding). The MoE
# model's: a dense block's 6, a MoE block's q, kv, out, the router, the experts' grouped gate, up and
# down (ragged_dot) and the shared experts' gate, up, down.
BLOCK_MATMULS = {'gpt': 4, 'llama': 6, 'llama_moe': 6 + 10}
MATMULS = ('dot_general', 'ragged_dot_general')  # the primitives a weight matmul may be


def shape_of(family: dict, **model) -> config_lib.ModelShape:
    c = config_lib.base_config()
    c.model.update(**{**family, **model})
    config_lib.validate(c)
    return config_lib.model_shape(c)


def record_seam(monkeypatch) -> list:
    """The seam, each call inside a named scope and recorded as (owner, weight name, bias name)."""
    calls = []
    project, project_grouped, add_bias = linear.project, linear.project_grouped, linear.add_bias

    def scoped_project(owner, name, letters, x, **kw):
        calls.append((owner, name, kw.get('bias')))
        with jax.named_scope(SEAM):
            return project(owner, name, letters, x, **kw)

    def scoped_grouped(owner, name, x, group_sizes, **kw):
        calls.append((owner, name, None))
        with jax.named_scope(SEAM):
            return project_grouped(owner, name, x, group_sizes, **kw)

    monkeypatch.setattr(linear, 'project_grouped', scoped_grouped)

    def recorded_add_bias(owner, name, y):
        calls.append((owner, None, name))
        return add_bias(owner, name, y)

    monkeypatch.setattr(linear, 'project', scoped_project)
    monkeypatch.setattr(linear, 'add_bias', recorded_add_bias)
    return calls


def loss_jaxpr(shape: config_lib.ModelShape) -> tuple[jex_core.Jaxpr, list]:
    """The traced loss of the family's model, and its input variables that are parameters."""
    model_def = params_lib.ModelDef.create(shape)
    params = model_def.abstract_params()
    tokens = jax.ShapeDtypeStruct((BATCH, shape.seq_len), jnp.int32)
    closed = jax.make_jaxpr(lambda p, x, y: model_def.bind(p).loss(x, y))(params, tokens, tokens)
    return closed.jaxpr, closed.jaxpr.invars[:len(jax.tree.leaves(params))]


def sub_jaxprs(eqn) -> list[jex_core.Jaxpr]:
    """The jaxprs inside an equation (scan, remat, pjit, custom_vjp, cond's branches, while, shard_map)."""
    found = []
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jex_core.ClosedJaxpr):
                found.append(v.jaxpr)
            elif isinstance(v, jex_core.Jaxpr):
                found.append(v)
    return found


def weight_matmuls(jaxpr: jex_core.Jaxpr, weights: set) -> tuple[list, set]:
    """(every dot_general, at any depth, with an operand that is one of `weights` handed on by
    PASS_THROUGH primitives; the variables of `jaxpr` that are such weights).

    A sub-jaxpr's inputs are its equation's last operands (cond's branches skip the index, while's
    body the condition's constants); its outputs that are weights make the equation's outputs weights.
    """
    found, weights = [], set(weights)
    for eqn in jaxpr.eqns:
        is_weight = [isinstance(v, jex_core.Var) and v in weights for v in eqn.invars]
        if eqn.primitive.name in MATMULS and any(is_weight):
            found.append(eqn)
        elif eqn.primitive.name in PASS_THROUGH and is_weight and is_weight[0]:
            weights.update(eqn.outvars)
        for sub in sub_jaxprs(eqn):
            inner = {v for v, w in zip(sub.invars, is_weight[len(is_weight) - len(sub.invars):]) if w}
            if inner:
                sub_found, sub_weights = weight_matmuls(sub, inner)
                found += sub_found
                if len(sub.outvars) == len(eqn.outvars):
                    weights.update(o for o, i in zip(eqn.outvars, sub.outvars) if i in sub_weights)
    return found, weights


def outside_seam(shape: config_lib.ModelShape) -> tuple[list, list]:
    """(the weight dot_generals of the family's loss, those of them not made by the seam)."""
    jaxpr, params = loss_jaxpr(shape)
    matmuls, _ = weight_matmuls(jaxpr, set(params))
    return matmuls, [e for e in matmuls if SEAM not in str(e.source_info.name_stack)]


@pytest.mark.parametrize('tied', [True, False], ids=['tied', 'untied'])
@pytest.mark.parametrize('family', [GPT, LLAMA, LLAMA_MOE], ids=['gpt', 'llama', 'llama_moe'])
@pytest.mark.parametrize('remat', ['none', 'full'])
def test_every_weight_matmul_goes_through_the_seam(monkeypatch, family, tied, remat):
    shape = shape_of(family, tied_embeddings=tied, remat=remat, dtype='bfloat16')
    record_seam(monkeypatch)
    matmuls, by_hand = outside_seam(shape)
    assert not by_hand, f'weight matmuls outside model/layers/linear.py: {by_hand}'
    # One copy of each group's block in its scanned body, and the head: nothing was missed by the tracing.
    kind = 'llama_moe' if 'moe_experts' in family else family['family']
    assert len(matmuls) == BLOCK_MATMULS[kind] + 1
    # The dtype policy: weights cast to the activations' (compute) dtype before they multiply; the MoE
    # router's in fp32 (its [d, E] weight: linear.FP32_WEIGHTS).
    for eqn in matmuls:
        router = eqn.invars[1].aval.shape == (shape.d_model, family.get('moe_experts', -1))
        dtype = jnp.float32 if router else jnp.bfloat16
        assert [v.aval.dtype for v in eqn.invars[:2]] == [dtype] * 2, eqn
    assert sum(eqn.primitive.name == 'ragged_dot_general' for eqn in matmuls) == (3 if kind == 'llama_moe' else 0)


def test_a_matmul_by_hand_is_caught(monkeypatch):
    """The check can fail: SwiGLU's up projection written as `x @ w` again is found outside the seam."""
    def by_hand(self, x_nd, key=None):
        gate_nf = linear.project(self, 'w_gate', 'nd,df->nf', x_nd)
        up_nf = x_nd @ self.w_up[...].astype(x_nd.dtype)
        return linear.project(self, 'w_down', 'nf,fd->nd', jax.nn.silu(gate_nf) * up_nf)

    monkeypatch.setattr(mlp.SwiGLU, '__call__', by_hand)
    record_seam(monkeypatch)
    matmuls, by_hand_found = outside_seam(shape_of(LLAMA, tied_embeddings=False, remat='full'))
    assert len(matmuls) == BLOCK_MATMULS['llama'] + 1
    assert len(by_hand_found) == 1 and by_hand_found[0].invars[0].aval.shape == (BATCH * LLAMA['seq_len'], 40)


@pytest.mark.parametrize('family', [GPT, LLAMA, LLAMA_MOE], ids=['gpt', 'llama', 'llama_moe'])
def test_pipeline_cast_prefixes_name_exactly_the_seams_block_parameters(monkeypatch, family):
    """pipeline/staggered.py casts block parameters named `CAST_PREFIXES` ahead of the seam's cast at use
    (`linear.cast_ahead`): the same policy only if those are exactly the block parameters the seam reads,
    less the ones it reads in fp32 (`FP32_WEIGHTS`: the MoE router, whose activations are fp32)."""
    shape = shape_of(family, tied_embeddings=False)
    calls = record_seam(monkeypatch)
    loss_jaxpr(shape)
    names = lambda in_blocks: {n for owner, *pair in calls if isinstance(owner, Decoder) != in_blocks  # noqa: E731
                               for n in pair if n is not None}
    blocks = params_lib.ModelDef.create(shape).abstract_params()['blocks']
    leaves = {str(path[-1].key) for path, _ in jax.tree_util.tree_flatten_with_path(blocks)[0]}
    assert names(True) == {n for n in leaves if n.startswith(linear.CAST_PREFIXES)}
    assert {n for n in names(True) if not linear.cast_ahead(n)} == ({'w_router'} if 'moe_experts' in family else set())
    assert names(False) == {'head'}  # the Decoder's own: the head, which the pipeline does not cast ahead
