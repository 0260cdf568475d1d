"""The Llama family: its parameter table, RoPE, RMSNorm, SwiGLU, grouped-query attention, and
every parallel layout, pipeline schedule, remat policy and attention kernel against one device.

The layout model (layout_check.LLAMA): 8 query heads sharing 2 kv heads, which tensor 4 and 8
do not divide (kv heads replicated there) and tensor 2 does (split), q/k/v biases, an untied
head, RoPE with Llama 3.1's scaling active. Tolerances are layout_check.py's.
"""

import importlib.util
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.model import attention as attention_lib
from jaxfrontier.model import layers
from jaxfrontier.model.layers import rope
from jaxfrontier.model import params as params_lib
from jaxfrontier import families
from jaxfrontier.families import llama as llama_family
from jaxfrontier.training import state as ts
from layout_check import LLAMA, LOSS_RTOL, assert_trees_close, check_against_reference, make_config, run_layout
from layout_once import run_layout_once

CONFIG_DIR = os.path.join(os.path.dirname(__file__), '..', '..', 'configs')
# Distinct sizes so a swapped axis fails: 3 layers, 40 wide, 4 heads of 10, 24 positions, 97 tokens, MLP 56.
SHAPE = dict(family='llama', num_layers=3, d_model=40, num_heads=4, seq_len=24, vocab_size=97, mlp_dim=56,
             dtype='float32', attention='reference', remat='none')


def llama_config(**model):
    c = config_lib.base_config()
    c.model.update(**{**SHAPE, **model})
    config_lib.validate(c)
    return c


def init(shape, seed=0, noise=0.0):
    """The model's initial parameters (jitted: eager initialisation compiles op by op), plus
    normal noise of std `noise` so that biases and norm scales are not 0 and 1."""
    def make(key):
        params = params_lib.init_params(shape, key)
        leaves, tree = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.fold_in(key, 1), len(leaves))
        return jax.tree.unflatten(tree, [a + noise * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys)])
    return jax.jit(make)(jax.random.key(seed))


def llama_configs_module():
    spec = importlib.util.spec_from_file_location('llama_config', os.path.join(CONFIG_DIR, 'llama.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- the parameter table


@pytest.mark.parametrize('tied', [True, False])
@pytest.mark.parametrize('kv,bias', [(1, False), (2, True), (4, False)], ids=['mqa', 'gqa_bias', 'mha'])
def test_param_specs_equal_eval_shape(kv, bias, tied):
    shape = config_lib.model_shape(llama_config(num_kv_heads=kv, qkv_bias=bias, tied_embeddings=tied))
    model_def = params_lib.ModelDef.create(shape)
    flat = lambda tree, **kw: {'/'.join(k.key for k in path): leaf for path, leaf in  # noqa: E731
                               jax.tree_util.tree_flatten_with_path(tree, **kw)[0]}
    abstract = flat(model_def.abstract_params())
    logical = flat(model_def.logical_specs(), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    specs = families.get('llama').param_specs(shape)
    assert sorted(p.path for p in specs) == sorted(abstract)
    for p in specs:
        assert p.shape == abstract[p.path].shape and p.names == tuple(logical[p.path]), p.path
    assert ('attn/b_q' in str(sorted(abstract))) == bias and ('head' in abstract) == (not tied)
    assert abstract['blocks/attn/w_kv'].shape == (3, 40, 2, kv, 10)


PUBLISHED = {'1b': 1_235_814_400, '3b': 3_212_749_824, '8b': 8_030_261_248, '70b': 70_553_706_496,
             '405b': 405_853_388_800}


@pytest.mark.parametrize('size', PUBLISHED)
def test_published_shapes_have_their_parameter_counts(size):
    """Meta's Llama 3.2 1B/3B and 3.1 8B/70B/405B, counted from configs/llama.py's shapes (tensor 1)."""
    c = llama_configs_module().get_config(f'size={size}')
    config_lib.validate(c)
    shape = config_lib.model_shape(c)
    assert sum(p.size for p in families.get('llama').param_specs(shape)) == PUBLISHED[size]


def test_llama_mlp_rule_gives_the_published_widths():
    assert llama_family.llama_mlp_dim(4096, 1.3, 1024) == 14336  # 8B
    assert llama_family.llama_mlp_dim(8192, 1.3, 4096) == 28672  # 70B
    assert llama_family.llama_mlp_dim(16384, 1.2, 4096) == 53248  # 405B


def test_flops_are_the_forward_count_in_megatrons_convention():
    """Model FLOPs per step = 3 passes of the family's forward count (the head at 3/4, Megatron's
    convention); recomputation adds one forward of everything (f = 4)."""
    c = llama_config(num_kv_heads=2, remat='full')
    c.train.global_batch = 6
    shape = config_lib.model_shape(c)
    layer, head = families.get('llama').forward_flops(shape)
    t, d, kv, f = 24, 40, 2 * 10, 56
    assert layer == 2 * t * (2 * d * d + 2 * d * kv + 3 * d * f) + 4 * t * t * d and head == 2 * t * d * 128
    model, hw = config_lib.flops_per_step(c)
    forward = 6 * (shape.num_layers * layer + head * 3 / 4)
    assert model == pytest.approx(3 * forward, rel=1e-12) and hw == pytest.approx(4 * forward, rel=1e-12)


# --------------------------------------------------------------------------- layers


def transformers_inv_freq(head_dim, theta, scaling):
    """transformers' `_compute_default_rope_parameters` / `_compute_llama3_parameters`, in float64 numpy."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    if scaling is None:
        return inv
    factor, low, high, old = scaling
    wavelen = 2 * math.pi / inv
    out = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return np.where(medium, smoothed, out)


@pytest.mark.parametrize('scaling', [None, (8.0, 1.0, 4.0, 64)], ids=['plain', 'llama3'])
def test_rope_matches_transformers_formula(scaling):
    """Frequencies, then q cos + rotate_half(q) sin at explicit per-row positions (HF's half split)."""
    k, theta = 32, 500000.0
    inv = transformers_inv_freq(k, theta, scaling)
    ours = rope.inverse_frequencies(k, theta, scaling)
    np.testing.assert_allclose(ours, inv, rtol=2e-6)
    if scaling is not None:  # the three bands all occur: kept, divided by the factor, blended
        ratio = ours / rope.inverse_frequencies(k, theta)
        assert np.isclose(ratio, 1).any() and np.isclose(ratio, 1 / 8).any() and ((ratio > 0.13) & (ratio < 0.99)).any()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 3, k)).astype(np.float32)
    pos = np.array([[0, 1, 2, 3, 4], [7, 100, 3000, 9, 0]])
    # transformers' angles are fp32 products of fp32 frequencies (position 3000's angle moves by
    # ~3e-4 with a frequency's last bit), so the rotation is checked on the frequencies checked above.
    angles = pos[..., None].astype(np.float32) * ours  # [B, T, K/2]
    cos, sin = (np.concatenate([f(angles)] * 2, axis=-1)[:, :, None] for f in (np.cos, np.sin))
    rotated = np.concatenate([-x[..., k // 2:], x[..., :k // 2]], axis=-1)
    expected = x * cos + rotated * sin
    got = rope.apply_rope(jnp.asarray(x), jnp.asarray(pos), ours)
    np.testing.assert_allclose(np.asarray(got), expected, atol=2e-5)


def test_rms_norm_and_swiglu_match_numpy():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, 10)).astype(np.float32)
    norm = layers.RMSNorm(10, eps=1e-6, rngs=None)
    norm.scale[...] = rng.normal(size=10).astype(np.float32)
    expected = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * norm.scale[...]
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), expected, rtol=1e-5)
    from flax import nnx  # pylint: disable=g-import-not-at-top
    mlp = layers.SwiGLU(10, 14, init_std=0.3, out_std=0.3, rngs=nnx.Rngs(0))
    g, u, d = (np.asarray(w[...]) for w in (mlp.w_gate, mlp.w_up, mlp.w_down))
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    np.testing.assert_allclose(np.asarray(mlp(jnp.asarray(x))), (silu(x @ g) * (x @ u)) @ d, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_grouped_query_attention_is_multi_head_with_shared_kv_heads():
    """G = 2 kv heads for 4 query heads equals multi-head attention whose head i has kv head i // 2
    (transformers' repeat_kv order): the logits of the two models agree."""
    gqa_shape = config_lib.model_shape(llama_config(num_kv_heads=2, qkv_bias=True))
    mha_shape = config_lib.model_shape(llama_config(num_kv_heads=4, qkv_bias=True))
    params = init(gqa_shape, noise=0.1)
    attn = params['blocks']['attn']
    mha = {**params, 'blocks': {**params['blocks'], 'attn': {
        **attn, 'w_kv': jnp.repeat(attn['w_kv'], 2, axis=3), 'b_kv': jnp.repeat(attn['b_kv'], 2, axis=2)}}}
    tokens = jax.random.randint(jax.random.key(2), (2, 24), 0, 97)
    logits = lambda shape, p: jax.jit(lambda p: params_lib.ModelDef.create(shape).bind(p)(tokens))(p)  # noqa: E731
    got, want = logits(gqa_shape, params), logits(mha_shape, mha)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert attention_lib.repeat_kv(jnp.arange(2.0).reshape(1, 1, 2, 1), 4).ravel().tolist() == [0, 0, 1, 1]


@pytest.mark.slow
def test_attention_kernels_agree_with_reference():
    """blockwise (3 blocks of 8) and xla against the reference kernel on one device, GQA with biases."""
    tokens = jax.random.randint(jax.random.key(2), (2, 25), 0, 97)  # 24 inputs: 3 blocks of 8
    shapes = {impl: config_lib.model_shape(llama_config(num_kv_heads=2, qkv_bias=True, attention=impl,
                                                        attention_block_q=8, attention_block_kv=8))
              for impl in ('reference', 'blockwise', 'xla')}
    params = init(shapes['reference'], noise=0.05)
    loss_grads = lambda s: jax.jit(jax.value_and_grad(  # noqa: E731
        lambda p: params_lib.ModelDef.create(s).bind(p).loss(tokens[:, :-1], tokens[:, 1:])))(params)
    ref_loss, ref_grads = loss_grads(shapes['reference'])
    for impl in ('blockwise', 'xla'):
        loss, grads = loss_grads(shapes[impl])
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=LOSS_RTOL)
        assert_trees_close(grads, ref_grads, f'{impl} grad')


# --------------------------------------------------------------------------- the rules


@pytest.mark.parametrize('tensor,split', [(2, True), (4, False)])
def test_kv_heads_split_where_they_divide_tensor_and_replicate_where_not(tensor, split):
    c = make_config(tensor=tensor, data=8 // tensor, **LLAMA)
    rules = dict(config_lib.sharding_rules(c))
    assert rules['kv_heads'] == ('tensor' if split else None) and rules['heads'] == 'tensor'
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices())
    placement = ts.make_placement(c, mesh)
    spec = placement.param_shardings['blocks']['attn']['w_kv'].spec
    assert (spec[3] == 'tensor') == split and placement.param_shardings['blocks']['attn']['w_q'].spec[2] == 'tensor'


# --------------------------------------------------------------------------- layouts against one device

LAYERS, BATCH = 4, 16


@pytest.fixture(scope='module')
def reference():
    """One device: step 0's loss and gradients, parameters after 3 steps."""
    return run_layout(make_config(layers=LAYERS, global_batch=BATCH, **LLAMA))


@pytest.fixture(scope='module')
def reference_step0():
    """One device: step 0's loss and gradients only (no train step compiled)."""
    return run_layout(make_config(layers=LAYERS, global_batch=BATCH, **LLAMA), steps=False)


def llama_layout(**kw):
    return make_config(layers=LAYERS, global_batch=BATCH, **kw, **LLAMA)


# kv heads replicated (tensor 4, 8: 2 kv heads) and split (tensor 2) across the layout matrix of
# tests/test_parallel.py (data 8 alone, which no llama-specific code meets, is left to GPT's
# matrix); the fast case mixes data with tensor 4 (the GQA case). Accumulation: d2f2t2.
LAYOUTS = {
    'd2t4': dict(data=2, tensor=4),
    'fsdp8': dict(fsdp=8),
    'tensor8': dict(tensor=8),
    'd2f2t2_accum2': dict(data=2, fsdp=2, tensor=2, accum=2),
    'zero1_d4t2': dict(data=4, tensor=2, zero1=True),
}


@pytest.mark.slow  # the fast tier's layout checks are GPT's (test_parallel, test_pipeline); Llama's are all here
def test_layout_step0_matches_single_device(reference_step0):
    """Step 0's loss and gradients on data 2 x tensor 4 (the optimizer steps: test_layout_matches_single_device)."""
    loss, grads, _ = run_layout(llama_layout(**LAYOUTS['d2t4']), steps=False)
    np.testing.assert_allclose(loss, reference_step0[0], rtol=LOSS_RTOL)
    assert_trees_close(grads, reference_step0[1], 'd2t4 grad')


@pytest.mark.slow
@pytest.mark.parametrize('name', LAYOUTS)
def test_layout_matches_single_device(name, reference):
    check_against_reference(run_layout_once(llama_layout(**LAYOUTS[name])), reference)


# (schedule, P, M, V, other axis): every schedule once, P = 2 (the executors' P = 4 cases are GPT's,
# tests/pipeline/test_pipeline.py); tensor 2 splits the kv heads, tensor 4 replicates them.
PIPELINES = [('gpipe', 2, 4, 1, dict(tensor=2)), ('1f1b', 2, 2, 1, dict(fsdp=2)),
             ('1f1b_lockstep', 2, 4, 1, dict(tensor=4)), ('interleaved', 2, 2, 2, dict(fsdp=2))]


@pytest.mark.slow
@pytest.mark.parametrize('schedule,p,m,virtual,other', PIPELINES, ids=[f'{c[0]}_p{c[1]}' for c in PIPELINES])
def test_pipeline_matches_single_device(schedule, p, m, virtual, other, reference):
    c = llama_layout(pipeline=p, schedule=schedule, virtual=virtual, accum=m, **other)
    check_against_reference(run_layout_once(c), reference)


@pytest.mark.slow
@pytest.mark.parametrize('remat', ['full', 'save_dots', 'save_dots_no_batch', 'save_dots_attention'])
def test_remat_policy_does_not_change_loss_or_grads(remat, reference_step0):
    loss, grads, _ = run_layout(llama_layout(remat=remat), steps=False)
    np.testing.assert_allclose(loss, reference_step0[0], rtol=LOSS_RTOL)
    assert_trees_close(grads, reference_step0[1], f'remat {remat} grad')


@pytest.mark.slow
@pytest.mark.parametrize('attention', ['reference', 'blockwise'])
def test_attention_kernel_in_a_tensor_layout_matches_xla_on_one_device(attention, reference_step0):
    """The layouts' reference run uses the xla kernel; these run data 2 x tensor 4 with the others."""
    loss, grads, _ = run_layout(llama_layout(attention=attention, data=2, tensor=4), steps=False)
    np.testing.assert_allclose(loss, reference_step0[0], rtol=LOSS_RTOL)
    assert_trees_close(grads, reference_step0[1], f'{attention} grad')


@pytest.mark.slow
def test_dropout_masks_do_not_depend_on_the_layout(reference_step0):
    """Step 0's loss and gradients with dropout on data 2 x tensor 4 equal one device's (see
    test_pipeline_dropout_matches_non_pipelined for why parameters after 3 steps are not compared)."""
    one, spread = llama_layout(), llama_layout(data=2, tensor=4)
    for c in (one, spread):
        c.model.dropout_rate = 0.1
    (loss, grads, _), (ref_loss, ref_grads, _) = run_layout(spread, steps=False), run_layout(one, steps=False)
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    assert_trees_close(grads, ref_grads, 'dropout grad')
    assert abs(reference_step0[0] - ref_loss) > 50 * LOSS_RTOL * ref_loss  # dropout was on


# --------------------------------------------------------------------------- the command line


def run_main(*args):
    """stdout of `python -m jaxfrontier.main` with configs/llama.py's tiny size on data 2 x tensor 2."""
    import processes  # pylint: disable=g-import-not-at-top
    proc = processes.run_main('--config=configs/llama.py:size=tiny,data=2,tensor=2', '--config.mesh.cpu_devices=4',
                              '--config.model.seq_len=32', '--config.train.log_every=1',
                              '--config.train.progress=False',
                              '--config.train.eval_batches=1', '--config.optim.decay_steps=100', *args,
                              tiny=False, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_main_trains_resumes_evaluates_and_samples(tmp_path):
    """configs/llama.py:size=tiny through the CLI: 4 steps with a checkpoint, a resume to 6, eval, greedy sample."""
    import processes  # pylint: disable=g-import-not-at-top
    workdir = str(tmp_path / 'run')
    run_main(f'--workdir={workdir}', '--config.train.steps=4', '--config.train.eval_every=0',
             '--config.checkpoint.every_steps=2')
    first = processes.read_metrics(workdir)
    assert [r['step'] for r in first] == [1, 2, 3, 4] and first[-1]['train/loss'] < first[0]['train/loss']
    run_main(f'--workdir={workdir}', '--config.train.steps=6', '--config.train.eval_every=0')
    resumed = processes.read_metrics(workdir)
    assert [r['step'] for r in resumed] == [1, 2, 3, 4, 5, 6] and 'eval/loss' in resumed[-1]

    result = json.loads(run_main(f'--workdir={workdir}', '--mode=eval').strip().splitlines()[-1])
    assert 0 < result['loss'] < math.log(256) and result['step'] == 6
    sampled = run_main(f'--workdir={workdir}', '--mode=sample', '--prompt=def ', '--temperature=0',
                       '--max_new_tokens=8')
    sampled = json.loads(sampled.strip().splitlines()[-1].removeprefix('sample: '))
    assert len(sampled['tokens'][0]) == 8


def test_checkpoints_know_the_family_and_its_kv_heads():
    """Resuming into other kv heads is one line naming the field; a reader (sample, eval, export) given
    a GPT config adopts the saved llama model, RoPE settings included."""
    from jaxfrontier.checkpoint import format as format_lib  # pylint: disable=g-import-not-at-top
    from jaxfrontier.errors import ConfigError  # pylint: disable=g-import-not-at-top
    from jaxfrontier.inference import load as load_lib  # pylint: disable=g-import-not-at-top
    saved = llama_config(num_kv_heads=2, rope_theta=500000.0).to_dict()
    with pytest.raises(ConfigError, match=r'model.num_kv_heads = 4: the checkpoint x was saved with model.num_kv_heads = 2'):
        format_lib.check_model_matches(saved, llama_config(num_kv_heads=4), 'x', 'use another workdir')
    adopted = load_lib.decode_config(config_lib.base_config(), saved['model'])
    assert (adopted.model.family, adopted.model.num_kv_heads, adopted.model.rope_theta) == ('llama', 2, 500000.0)
    config_lib.validate(adopted)
