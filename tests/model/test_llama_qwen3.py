"""The Llama family with Qwen3's dense features: QK-norm and heads of a width of their own (model.qk_norm,
model.head_dim), and every place that took a head to be d_model / num_heads wide.

The layout model (QWEN3): width 64, 8 query heads of 12 (q 96 wide, not 64) sharing 2 kv heads (split
over tensor 2) or one (MQA: replicated over tensor 2), QK-norm, no biases, RoPE theta 1e6, an untied
head. Against one device (layout_check.py's tolerances): fast, data 2 x fsdp 2 x tensor 2 with the kv
head replicated, step 0; slow, tensor 2 with the kv heads split and replicated, fsdp 8, a 1F1B pipeline
with tensor 2 and context 2 (ring attention over heads 12 wide), over 3 optimizer steps, the three
kernels against each other, and a --mode=verify certificate of Qwen3-30B-A3B's attention shape. Also: the
parameter table and FLOPs, the checks, the planner's proxy and sizes, and the verify shrink, which keeps
the head width apart from d_model / num_heads. Numbers against transformers: tests/checkpoint/test_hf_qwen3.py.
"""

import jax
import numpy as np
import pytest

from jaxfrontier import config as config_lib
from jaxfrontier import families
from jaxfrontier import flops as flops_lib
from jaxfrontier import layout as layout_lib
from jaxfrontier.errors import ConfigError
from jaxfrontier.model import params as params_lib
from jaxfrontier.plan import activations
from jaxfrontier.plan import estimate
from jaxfrontier.plan import shrink as shrink_lib
from layout_check import LOSS_RTOL, assert_trees_close, check_against_reference, make_config, run_layout
from layout_once import run_layout_once

QWEN3 = dict(family='llama', num_kv_heads=2, qk_norm=True, head_dim=12, mlp_dim=96, rope_theta=1e6, norm_eps=1e-6)
MQA = dict(QWEN3, num_kv_heads=1)
LAYERS, BATCH = 4, 16


def llama_config(**model):
    """3 layers, 40 wide, 4 heads of 14 (not 40 / 4 = 10), 2 kv heads, QK-norm; fields overridable."""
    c = config_lib.base_config()
    c.model.update(**{**dict(family='llama', num_layers=3, d_model=40, num_heads=4, num_kv_heads=2, head_dim=14,
                             qk_norm=True, seq_len=24, vocab_size=97, mlp_dim=56, dtype='float32'), **model})
    config_lib.validate(c)
    return c


# --------------------------------------------------------------------------- the shape, table and FLOPs


@pytest.mark.parametrize('fields', [dict(), dict(qk_norm=False), dict(head_dim=0), dict(num_kv_heads=1)],
                         ids=['qwen3', 'no_qk_norm', 'head_dim_rule', 'mqa'])
def test_param_specs_equal_eval_shape(fields):
    shape = config_lib.model_shape(llama_config(**fields))
    k = 14 if shape.explicit_head_dim else 10
    assert shape.head_dim == k
    model_def = params_lib.ModelDef.create(shape)
    flat = lambda tree, **kw: {'/'.join(x.key for x in path): leaf for path, leaf in  # noqa: E731
                               jax.tree_util.tree_flatten_with_path(tree, **kw)[0]}
    abstract = flat(model_def.abstract_params())
    logical = flat(model_def.logical_specs(), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    specs = families.get('llama').param_specs(shape)
    assert sorted(p.path for p in specs) == sorted(abstract)
    for p in specs:
        assert p.shape == abstract[p.path].shape and p.names == tuple(logical[p.path]), p.path
    g = shape.kv_heads
    assert abstract['blocks/attn/w_q'].shape == (3, 40, 4, k) and abstract['blocks/attn/w_out'].shape == (3, 4, k, 40)
    assert abstract['blocks/attn/w_kv'].shape == (3, 40, 2, g, k)
    assert ('blocks/attn/q_norm/scale' in abstract) == shape.qk_norm
    if shape.qk_norm:  # one scale per layer and head width, shared by the heads, whole on every device
        assert abstract['blocks/attn/k_norm/scale'].shape == (3, k)
        assert tuple(logical['blocks/attn/q_norm/scale']) == ('layers', 'head_dim')


def test_flops_count_the_query_width():
    """q, k, v, the output projection and attention are h K wide (56 here), not d (40); Megatron-LM's
    count scales its attention by q / d as its `query_projection_to_hidden_size_ratio` does."""
    c = llama_config(remat='full')
    c.train.global_batch = c.train.micro_batch = 6
    shape = config_lib.model_shape(c)
    layer, head = families.get('llama').forward_flops(shape)
    t, d, q, kv, f = 24, 40, 4 * 14, 2 * 14, 56
    assert layer == 2 * t * (2 * d * q + 2 * d * kv + 3 * d * f) + 4 * t * t * q and head == 2 * t * d * 128
    model, hw = config_lib.flops_per_step(c)
    forward = 6 * (shape.num_layers * layer + head * 3 / 4)
    assert model == pytest.approx(3 * forward, rel=1e-12) and hw == pytest.approx(4 * forward, rel=1e-12)
    # The planner's count: the same layer; its blockwise kernel skips (1 - share) of the h K-wide attention.
    c.model.update(attention='blockwise', attention_block_q=8, attention_block_kv=8)
    shape = config_lib.model_shape(c)
    plan = estimate.flops(shape, layout_lib.Layout.from_config(c), 'blockwise')
    share = estimate.blockwise_attention_share(shape)
    assert plan.model == 3 * 6 * (3 * layer + head) and share < 1
    assert plan.layer_forward == pytest.approx(6 * (layer - (1 - share) * 4 * t * t * q), rel=1e-12)
    # q = d is the count without a query width of its own
    args = (8, 2048, 16, 4096, 128256, 0.25, 14336, True)
    assert flops_lib.gated_gqa_flops_per_step(*args, query_projection_size=4096) == \
        flops_lib.gated_gqa_flops_per_step(*args)


@pytest.mark.slow
def test_attention_kernels_agree_with_reference():
    """blockwise (3 blocks of 8) and xla against the reference kernel on one device, heads of 14 with QK-norm."""
    tokens = jax.random.randint(jax.random.key(2), (2, 25), 0, 97)  # 24 inputs: 3 blocks of 8
    shapes = {impl: config_lib.model_shape(llama_config(attention=impl, attention_block_q=8, attention_block_kv=8))
              for impl in ('reference', 'blockwise', 'xla')}
    params = jax.jit(lambda key: params_lib.init_params(shapes['reference'], key))(jax.random.key(0))
    loss_grads = lambda s: jax.jit(jax.value_and_grad(  # noqa: E731
        lambda p: params_lib.ModelDef.create(s).bind(p).loss(tokens[:, :-1], tokens[:, 1:])))(params)
    ref_loss, ref_grads = loss_grads(shapes['reference'])
    for impl in ('blockwise', 'xla'):
        loss, grads = loss_grads(shapes[impl])
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=LOSS_RTOL)
        assert_trees_close(grads, ref_grads, f'{impl} grad')


# --------------------------------------------------------------------------- the checks


@pytest.mark.parametrize('model,field,said', [
    (dict(head_dim=13), 'model.head_dim = 13', 'must be even for rotary embeddings'),
    (dict(head_dim=-2), 'model.head_dim = -2', 'must be an integer >= 0'),
    (dict(family='gpt', qk_norm=True, head_dim=0, num_kv_heads=0), 'model.qk_norm = True', 'only the llama family'),
    (dict(family='gpt', qk_norm=False, head_dim=16, num_kv_heads=0), 'model.head_dim = 16', 'only the llama family'),
])
def test_checks_are_one_line(model, field, said):
    with pytest.raises(ConfigError) as e:
        llama_config(**model)
    assert field in str(e.value) and said in str(e.value) and 'Fix:' in str(e.value) and '\n' not in str(e.value)


def test_a_gpt_may_state_its_own_head_width():
    """head_dim = d_model / num_heads means what 0 means: a GPT config may carry it."""
    llama_config(family='gpt', qk_norm=False, head_dim=10, num_kv_heads=0)


# --------------------------------------------------------------------------- the planner and the verify shrink


def test_planner_proxy_keeps_qk_norm_and_the_head_width():
    """The traced proxy has QK-norm (its fp32 statistics are residuals: more bytes than without) and, with
    heads not d / h wide, a d apart from h k, so an h k-wide array is never sized as a d-wide one."""
    shape = config_lib.model_shape(llama_config())
    plain = config_lib.model_shape(llama_config(qk_norm=False, head_dim=0))
    assert families.get('llama').proxy_choice(shape) == (True, True, True)
    sizes = activations.act_sizes(shape, micro_batch=2, tensor=2, fsdp=1, weight=False)
    assert (sizes['k'], sizes['c'], sizes['h'], sizes['d']) == (14, 7, 2, 40)
    with_norm = activations.residual_bytes(activations.for_shape(shape, 'none', 'xla').block, sizes, sizes)
    without = activations.residual_bytes(activations.for_shape(
        config_lib.model_shape(llama_config(qk_norm=False)), 'none', 'xla').block, sizes, sizes)
    assert with_norm > without
    assert activations.for_shape(plain, 'none', 'xla') != activations.for_shape(shape, 'none', 'xla')


@pytest.mark.parametrize('head_dim,wider', [(128, True), (48, False), (64, None)], ids=['wider', 'narrower', 'equal'])
def test_shrink_keeps_the_head_width_apart_on_its_side(head_dim, wider):
    """Qwen3-30B-A3B's attention (d 2048, 32 heads of 128 over 4 kv heads: q twice d wide) on tensor 4 x
    fsdp 2 x pipeline 2: the small model's heads are not d / h wide either, and on the same side; heads
    stated as d / h (64) become the rule's 0."""
    c = config_lib.base_config()
    c.model.update(family='llama', num_layers=4, d_model=2048, num_heads=32, num_kv_heads=4, head_dim=head_dim,
                   qk_norm=True, mlp_dim=768, multiple_of=64)
    c.mesh.update(tensor=4, fsdp=2, pipeline=2)
    c.train.update(global_batch=8, micro_batch=2, accum_steps=2)
    s = shrink_lib.shrink(c)
    m = s.config.model
    small = config_lib.model_shape(s.config)
    assert m.qk_norm and s.kept['model.qk_norm'] is True and small.d_model < 2048
    if wider is None:
        assert m.head_dim == 0 and 'head width apart from d_model / num_heads' not in s.kept
    else:
        assert s.kept['head width apart from d_model / num_heads'] is True
        assert small.head_dim % 2 == 0 and (small.head_dim * small.num_heads > small.d_model) == wider
        assert small.head_dim != small.d_model // small.num_heads
    config_lib.validate(shrink_lib.reference_config(s.config), 1)


@pytest.mark.slow
def test_verify_certificate_passes_for_a_qwen3_layout():
    """--mode=verify's check of Qwen3-30B-A3B's attention shape (heads twice d / h wide, QK-norm) on tensor 2
    x fsdp 2 x data 2: the shrunk model (heads still apart from d / h) against one device."""
    from jaxfrontier.plan import verify  # pylint: disable=import-outside-toplevel
    c = config_lib.base_config()
    c.model.update(family='llama', num_layers=4, d_model=2048, num_heads=32, num_kv_heads=4, head_dim=128,
                   qk_norm=True, mlp_dim=768, remat='full')
    c.mesh.update(tensor=2, fsdp=2, data=2)
    c.train.update(global_batch=16, micro_batch=2, accum_steps=2)
    s = shrink_lib.shrink(c, max_devices=8)
    small = config_lib.model_shape(s.config)
    assert small.head_dim * small.num_heads == 2 * small.d_model and small.qk_norm
    cert = verify.certificate('qwen3', s)
    assert cert['passed'], verify.summary(cert)


# --------------------------------------------------------------------------- layouts against one device


def qwen3_layout(model=QWEN3, **kw):
    return make_config(layers=LAYERS, global_batch=BATCH, **kw, **model)


def test_layout_step0_with_replicated_kv_head_matches_single_device():
    """Step 0's loss and gradients on data 2 x fsdp 2 x tensor 2, one kv head replicated over tensor."""
    reference = run_layout(qwen3_layout(MQA), steps=False)
    loss, grads, _ = run_layout(qwen3_layout(MQA, data=2, fsdp=2, tensor=2), steps=False)
    np.testing.assert_allclose(loss, reference[0], rtol=LOSS_RTOL)
    assert_trees_close(grads, reference[1], 'd2f2t2 grad')
    assert grads['blocks']['attn']['q_norm']['scale'].shape == (LAYERS, 12)


@pytest.fixture(scope='module')
def references():
    """One device, per model: step 0's loss and gradients, parameters after 3 steps."""
    return {'gqa': run_layout(qwen3_layout(QWEN3)), 'mqa': run_layout(qwen3_layout(MQA))}


# (model, layout): tensor 2 splits the 2 kv heads and replicates the one; fsdp; a pipeline; context's ring.
LAYOUTS = {
    't2_kv_split_d4': ('gqa', dict(data=4, tensor=2)),
    't2_kv_replicated_d2_accum2': ('mqa', dict(data=2, tensor=2, accum=2)),
    'fsdp8': ('gqa', dict(fsdp=8)),
    '1f1b_p2_t2': ('gqa', dict(pipeline=2, schedule='1f1b', accum=2, tensor=2)),
    'c2_t2': ('gqa', dict(context=2, tensor=2)),
}


@pytest.mark.slow
@pytest.mark.parametrize('name', LAYOUTS)
def test_layout_matches_single_device(name, references):
    model, kw = LAYOUTS[name]
    check_against_reference(run_layout_once(qwen3_layout(QWEN3 if model == 'gqa' else MQA, **kw)), references[model])
