"""LoRA on the matmul seam (model/layers/linear.py, families/lora.py, model/lora.py): the model with adapters
computes the base model with W + alpha / r a b, a fresh adapter (b = 0) leaves the base model as it was, the
parameter table lists the adapters as eval_shape makes them, and the numpy merge (export) is the JAX one.

Targets are chosen so that a fused weight is adapted in part (Llama's w_kv: v only; GPT's w_qkv: q and v, not
k) and a row-parallel one (o: two contracted dimensions) is among them. Sizes are distinct where they can be,
so a swapped axis fails; fp32 throughout.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfrontier import config as config_lib
from jaxfrontier import families
from jaxfrontier.errors import ConfigError
from jaxfrontier.families import lora as lora_np
from jaxfrontier.model import lora as lora_lib
from jaxfrontier.model import params as params_lib
from jaxfrontier.plan import estimate

GPT = dict(family='gpt', num_layers=2, d_model=40, num_heads=4, seq_len=13, vocab_size=251, vocab_multiple=1,
           mlp_dim=68, attention='reference', dtype='float32')
LLAMA = dict(family='llama', num_layers=2, d_model=40, num_heads=4, num_kv_heads=2, qkv_bias=True, seq_len=13,
             vocab_size=251, vocab_multiple=1, mlp_dim=68, attention='reference', dtype='float32',
             tied_embeddings=False)
CASES = {'llama': (LLAMA, 'q,v,o,down'), 'gpt': (GPT, 'q,v,o,up'),
         'llama_all': (LLAMA, 'q,k,v,o,gate,up,down')}


def config_of(model: dict, targets: str, rank: int = 3, **lora):
    c = config_lib.base_config()
    c.model.update(**model)
    c.lora.update(rank=rank, targets=targets, alpha=6.0, **lora)
    config_lib.validate(c)
    return c


def with_random_b(params, seed=1):
    """The adapters' b drawn instead of zero (a trained adapter), so that it changes the output."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree_util.tree_unflatten(treedef, [
        0.05 * jax.random.normal(k, x.shape) if str(path[-1].key).endswith('_lora_b') else x
        for (path, x), k in zip(leaves, keys)])


def loss_of(shape, params, tokens, key=None):
    return params_lib.ModelDef.create(shape).bind(params).loss(tokens[:, :-1], tokens[:, 1:], key)


def tokens_of(seq_len, batch=3):
    return jax.random.randint(jax.random.key(7), (batch, seq_len + 1), 0, 251)


@pytest.mark.parametrize('case', [c if c == 'llama' else pytest.param(c, marks=pytest.mark.slow) for c in sorted(CASES)])
def test_forward_equals_the_merged_weights(case):
    """x W + alpha / r (x a) b through the seam = x (W + alpha / r a b): the model with adapters against the
    model without them on the merged weights (model/lora.merge), and families/lora.merged (numpy) = merge."""
    model, targets = CASES[case]
    c = config_of(model, targets)
    shape = config_lib.model_shape(c)
    params = with_random_b(params_lib.init_params(shape, jax.random.key(0)))
    merged = lora_lib.merge(params, shape.lora)
    base_shape = dataclasses.replace(shape, lora=None)
    assert jax.tree.structure(merged) == jax.tree.structure(params_lib.ModelDef.create(base_shape).abstract_params())
    tokens = tokens_of(shape.seq_len)
    with_adapters, on_merged = loss_of(shape, params, tokens), loss_of(base_shape, merged, tokens)
    adapters, base = lora_lib.split(params)
    assert abs(float(with_adapters) - float(loss_of(base_shape, base, tokens))) > 1e-4  # the adapters do something
    np.testing.assert_allclose(with_adapters, on_merged, rtol=2e-6)
    for weight in shape.lora.weights():
        w, a, b = (np.asarray(_flat(tree)[f'blocks/{weight}{sfx}']) for tree, sfx in
                   ((base, ''), (adapters, '_lora_a'), (adapters, '_lora_b')))
        numpy = np.stack([lora_np.merged(w[i], a[i], b[i], shape.lora, weight) for i in range(shape.num_layers)])
        np.testing.assert_allclose(numpy, _flat(merged)[f'blocks/{weight}'], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('case', ['llama', 'gpt'])
def test_fresh_adapters_leave_the_base_model(case):
    """b starts at zero (PEFT's init): step 0 computes exactly what the base model does."""
    model, targets = CASES[case]
    shape = config_lib.model_shape(config_of(model, targets))
    params = params_lib.init_params(shape, jax.random.key(0))
    adapters, base = lora_lib.split(params)
    assert all(not np.any(np.asarray(x)) for path, x in jax.tree_util.tree_leaves_with_path(adapters)
               if str(path[-1].key).endswith('_lora_b'))
    assert any(np.any(np.asarray(x)) for x in jax.tree.leaves(adapters))  # a is drawn
    tokens = tokens_of(shape.seq_len)
    assert float(loss_of(shape, params, tokens)) == float(loss_of(dataclasses.replace(shape, lora=None), base, tokens))


def test_adapters_off_computes_the_base_model():
    """DPO's reference under LoRA (model/lora.adapters_off): the model with trained adapters, traced inside it,
    computes its base model exactly, and with the adapters again outside it (jit traces twice: no stale trace)."""
    model, targets = CASES['llama']
    shape = config_lib.model_shape(config_of(model, targets))
    params = with_random_b(params_lib.init_params(shape, jax.random.key(0)))
    tokens = tokens_of(shape.seq_len)

    def reference(p):
        with lora_lib.adapters_off():
            return loss_of(shape, p, tokens)

    off = jax.jit(reference)(params)
    on = jax.jit(lambda p: loss_of(shape, p, tokens))(params)
    assert float(off) == float(loss_of(dataclasses.replace(shape, lora=None), lora_lib.split(params)[1], tokens))
    assert abs(float(on) - float(off)) > 1e-4


def test_save_dots_keeps_no_adapter_product():
    """Under remat=save_dots the adapters add their x a ([tokens, r] per target) to a layer's residuals, not
    (x a) b, as large as the base matmul's output: the backward recomputes it from x a and b (r / in of the base
    matmul's work). Without the policy (layers/linear.py `without_adapter_products`) Llama 8B on Frontier's layout
    compiled to 47 % more memory per device than full fine-tuning, with it 8.5 % less (benchmarks/lora_memory.py)."""
    from jax._src.ad_checkpoint import saved_residuals  # pylint: disable=import-outside-toplevel
    sizes = {}
    for rank in (0, 3):
        c = config_of(dict(LLAMA, remat='save_dots'), 'q,k,v,o,gate,up,down', rank=rank)
        shape = config_lib.model_shape(c)
        model_def = params_lib.ModelDef.create(shape)
        adapters, base = lora_lib.split(model_def.abstract_params())
        tokens = jax.ShapeDtypeStruct((3, shape.seq_len), jnp.int32)
        saved = saved_residuals(lambda a, b, t: model_def.bind(lora_lib.join(b, a)).loss(t, t), adapters, base,
                                tokens)
        sizes[rank] = sum(x.size * x.dtype.itemsize for x, why in saved if not why.startswith('from the argument'))
    assert sizes[3] - sizes[0] == LLAMA['num_layers'] * 3 * LLAMA['seq_len'] * 3 * 7 * 4  # L x tokens x r x 7 x fp32


@pytest.mark.parametrize('case', sorted(CASES))
def test_parameter_table_lists_the_adapters_as_eval_shape_makes_them(case):
    """The planner's table (estimate.param_specs: the family's and families/lora.adapter_specs) = the module's
    parameters under eval_shape, paths, shapes and logical names; a fused weight's adapters cover its
    targeted slices only."""
    model, targets = CASES[case]
    shape = config_lib.model_shape(config_of(model, targets))
    model_def = params_lib.ModelDef.create(shape)
    abstract = {path: a.shape for path, a in _flat(model_def.abstract_params()).items()}
    names = {path: tuple(spec) for path, spec in _flat(model_def.logical_specs()).items()}
    specs = estimate.param_specs(shape)
    assert {p.path: p.shape for p in specs} == abstract
    assert {p.path: tuple(p.names) for p in specs} == names
    fused = 'blocks/attn/w_kv_lora_b' if case == 'llama' else 'blocks/attn/w_qkv_lora_b'
    if fused in abstract:
        assert abstract[fused][1] == len(shape.lora.slices(fused.removeprefix('blocks/').removesuffix('_lora_b')))


def _flat(tree):
    return {'/'.join(str(k.key) for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]}


def test_split_and_join_are_inverse():
    shape = config_lib.model_shape(config_of(LLAMA, 'q,v,o,down'))
    params = params_lib.init_params(shape, jax.random.key(0))
    adapters, base = lora_lib.split(params)
    assert all(lora_np.is_adapter(p) for p in _flat(adapters)) and not any(lora_np.is_adapter(p) for p in _flat(base))
    assert jax.tree.structure(lora_lib.join(base, adapters)) == jax.tree.structure(params)


def test_peft_pair_is_the_adapters_of_a_torch_linear():
    """PEFT's lora_B @ lora_A [out, in] is the delta of the HF tensor of each target (the converter's to_hf of
    our delta): q (one weight), k and v (slices of w_kv), o (two contracted dimensions)."""
    shape = config_lib.model_shape(config_of(LLAMA, 'q,k,v,o,gate,up,down'))
    params = with_random_b(params_lib.init_params(shape, jax.random.key(0)))
    adapters, base = lora_lib.split(params)
    hf, lora = families.get('llama').hf, shape.lora
    for t in lora.targets:
        a = np.asarray(_flat(adapters)[f'blocks/{t.weight}_lora_a'][0])
        b = np.asarray(_flat(adapters)[f'blocks/{t.weight}_lora_b'][0])
        w_shape = _flat(base)[f'blocks/{t.weight}'].shape[1:]
        delta = lora_np.delta(a, b, t.contracted, lora.slices(t.weight), w_shape)
        theirs = hf.to_hf(t.weight, delta)[0 if t.index is None else t.index]
        lora_a, lora_b = lora_np.peft_pair(a, b, lora, t)
        assert lora_a.shape == (lora.rank, theirs.shape[1]) and lora_b.shape == (theirs.shape[0], lora.rank)
        np.testing.assert_allclose(lora_b @ lora_a, theirs, rtol=1e-5, atol=1e-7, err_msg=t.name)


@pytest.mark.parametrize('lora, needle', [
    (dict(targets='q,qkv'), "'qkv' matches nothing in the llama family (its targets: q,k,v,o,gate,up,down)"),
    (dict(targets='q,gate', model=GPT), "'gate' matches nothing in the gpt family"),
    (dict(rank=21), "config.lora.rank = 21: is larger than the 'v' matrix allows (attn/w_kv: 40 x 20, rank at most "
                    '20)'),
    (dict(rank=-1), 'config.lora.rank = -1: must be an integer >= 0'),
    (dict(dropout=1.0), 'config.lora.dropout = 1.0: must be in [0, 1)'),
    (dict(alpha=0.0), 'config.lora.alpha = 0.0: must be a finite number > 0'),
    (dict(targets='q,q'), 'names a target twice'),
    (dict(pipeline=2), 'config.mesh.pipeline = 2: LoRA does not run in a pipeline'),
    (dict(targets='q,gate,up', model=dict(LLAMA, moe_experts=4)),  # Mixtral: every MLP is experts
     "config.lora.targets = 'q,gate,up': gate,up match no dense weight of this model (its MLPs are "
     'mixture-of-experts experts, which take no LoRA adapters). Fix: drop gate,up from lora.targets (lora.targets=q)'),
    (dict(rank=0), "config.lora.targets = 'q,v': is set, but lora.rank = 0 turns LoRA off"),
])
def test_bad_lora_configs_are_one_line(lora, needle):
    lora = dict(lora)
    model = lora.pop('model', dict(LLAMA, head_dim=10))
    pipeline = lora.pop('pipeline', 1)
    c = config_lib.base_config()
    c.model.update(**model)
    c.lora.update(**{'rank': 3, 'targets': 'q,v', **lora})
    if pipeline > 1:
        c.mesh.pipeline, c.train.accum_steps, c.train.global_batch = pipeline, 2, 16
    with pytest.raises(ConfigError) as e:
        config_lib.validate(c)
    assert needle in str(e.value) and '\n' not in str(e.value), str(e.value)


def test_lora_rank_zero_adds_nothing():
    """rank 0 (the default): the model, its table and its parameters are the base model's."""
    c = config_lib.base_config()
    c.model.update(**LLAMA)
    assert config_lib.model_shape(c).lora is None
    assert not any(lora_np.is_adapter(p.path) for p in estimate.param_specs(config_lib.model_shape(c)))


def test_dropout_on_the_adapter_input_only_in_training():
    """lora.dropout masks the adapter's input when the block has a key (training), not without one (eval)."""
    c = config_of(LLAMA, 'q,v', dropout=0.5)
    shape = config_lib.model_shape(c)
    params = with_random_b(params_lib.init_params(shape, jax.random.key(0)))
    model = params_lib.ModelDef.create(shape).bind(params)
    tokens = tokens_of(shape.seq_len)
    evaluation = loss_of(shape, params, tokens)
    assert float(evaluation) == float(loss_of(shape, params, tokens))
    trained = [float(loss_of(shape, params, tokens, jax.random.key(k))) for k in (3, 4)]
    assert trained[0] != float(evaluation) and trained[0] != trained[1]
    base = config_lib.model_shape(config_of(LLAMA, 'q,v'))  # the same adapters without dropout: no mask
    assert float(loss_of(base, params, tokens, jax.random.key(3))) == float(evaluation)


@pytest.mark.slow
def test_loss_is_differentiable_in_the_adapters_alone():
    """jax.grad of the adapters with the base closed over: gradients shaped like the adapters, nonzero for
    a and b once b is not zero."""
    shape = config_lib.model_shape(config_of(LLAMA, 'q,v,o,down'))
    adapters, base = lora_lib.split(with_random_b(params_lib.init_params(shape, jax.random.key(0))))
    tokens = tokens_of(shape.seq_len)
    grads = jax.grad(lambda a: loss_of(shape, lora_lib.join(base, a), tokens))(adapters)
    assert jax.tree.structure(grads) == jax.tree.structure(adapters)
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(grads))
