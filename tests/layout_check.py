"""Single-device reference checks shared by the layout tests (test_parallel, test_pipeline).

Every parallel layout computes what one device computes, to fp32 rounding.

For each layout (data 8; fsdp 8; tensor 8; data 2 x fsdp 2 x tensor 2; ZeRO-1 with data 4 x
tensor 2), with and without gradient accumulation: the loss and gradients of the first step,
and the parameters after 3 optimizer steps, equal a single-device run on the same global
batch. Tolerances (fp32 compute, fp32 params): loss rtol 2e-6; gradients and parameters
atol 2e-6 + rtol 2e-5 elementwise. Adam's update lr * g / (|g| + eps) turns a rounding
difference delta of a small gradient into a parameter difference of up to lr * delta / eps per
step, so the test uses lr 1e-3 and eps 1e-5 (amplification <= 1e2). Measured: the Llama
layouts' wte[127, 19] has a step-0 gradient of -7.1e-8; the same one-device program compiled
with LLVM at O0 and at O2 (tests/conftest.py) gives it values 7.9e-10 apart, and fsdp 8 at O0
2.6e-9 from one device, which eps 1e-6 (amplification 1e3) turned into 2.3e-6 after 3 steps,
past atol. Such an element's gradient is a near-cancelling sum, so its rounding is relative to
the summands, not to the sum. The tolerances allow reduction-order differences only: a wrong
shard, a missing all-reduce, a mis-ordered micro-batch or a misplaced optimizer state is off by
O(lr) = 1e-3 in the parameters, orders of magnitude past them.

One exception, by mathematics rather than tolerance: the key bias. softmax(q.(k + b)) does not
depend on b (it adds the same q.b to every score of a row), so its true gradient is exactly 0
and every layout computes only rounding noise (~1e-9) there, which Adam divides by
sqrt(v) + eps and turns into arbitrary O(lr) updates. The test asserts that this gradient is
~0 in every layout and compares the parameters without that slice.
"""

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.training import step as step_lib
from jaxfrontier.training import state as ts
from jaxfrontier.model import params as params_lib

GLOBAL_BATCH, SEQ = 16, 24
LOSS_RTOL = 2e-6
TREE_ATOL, TREE_RTOL = 2e-6, 2e-5


# The Llama layouts' model (make_config(**LLAMA)): 8 query heads sharing 2 kv heads, which
# tensor 4 and 8 do not divide (replicated there, split on tensor 2), q/k/v biases, an untied
# head, RoPE with Llama 3.1's scaling active at this length (original length 16 < SEQ).
LLAMA = dict(family='llama', num_kv_heads=2, qkv_bias=True, mlp_dim=96, rope_scaling='llama3',
             rope_original_max_len=16)


def make_config(data=1, fsdp=1, tensor=1, accum=1, zero1=False, remat='none', attention='xla', pipeline=1,
                schedule='1f1b', virtual=1, layers=2, global_batch=GLOBAL_BATCH, optimizer='adamw', context=1,
                expert=1, **model):
    """The layout tests' config; `model`: further model.* fields (LLAMA: the Llama family's).

    `optimizer`: optim.name; Adafactor factors weights whose two largest dimensions are >= 32
    here (d_model 64, MLP 256, vocabulary 256), so the factored state's placement is exercised.
    """
    c = config_lib.base_config()
    c.model.update(num_layers=layers, d_model=64, num_heads=8, seq_len=SEQ, vocab_size=250, vocab_multiple=32,
                   dtype='float32', remat=remat, attention=attention, tied_embeddings=False, **model)
    c.mesh.update(data=data, fsdp=fsdp, tensor=tensor, pipeline=pipeline, context=context, expert=expert)
    c.pipeline.update(schedule=schedule, virtual_stages=virtual)
    dp = data * fsdp * expert
    c.train.update(global_batch=global_batch, micro_batch=global_batch // (dp * accum), accum_steps=accum, steps=3)
    c.optim.update(lr=1e-3, min_lr=1e-4, warmup_steps=0, eps=1e-5, name=optimizer, factor_min_dim=32)
    c.sharding.zero1 = zero1
    config_lib.validate(c, config_lib.num_devices(c))
    return c


def batches(global_batch, n=3):
    rng = np.random.default_rng(0)
    # 250 real tokens in a vocabulary padded to 256: the padding must not change the loss.
    return [rng.integers(0, 250, (global_batch, SEQ + 1), dtype=np.int32) for _ in range(n)]


def run_layout(c, steps=True):
    """(loss, grads) of step 0 and params after 3 steps, as numpy, for config `c`.

    steps=False: only (loss, grads) of step 0, without compiling the train step (params None).
    """
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:config_lib.num_devices(c)])
    layout = ts.make_placement(c, mesh)
    state = ts.init_train_state(c, layout)
    sharding = NamedSharding(mesh, mesh_lib.batch_spec(layout.rules))
    data = [jax.device_put(b, sharding) for b in batches(c.train.global_batch)]
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        loss, grads = jax.jit(step_lib.make_loss_and_grads(c, layout))(state['params'], data[0], 0)
        loss, grads = jax.device_get((loss, grads))
        if not steps:
            return float(loss), params_lib.merge_virtual(grads), None
        step = jax.jit(step_lib.make_train_step(c, layout), donate_argnums=0)
        for batch in data:
            state, _ = step(state, batch)
    # Interleaved pipelines store blocks as [V, L / V, ...]; compare in model order [L, ...].
    return float(loss), params_lib.merge_virtual(grads), params_lib.merge_virtual(jax.device_get(state['params']))


def without_key_bias(params):
    """Parameters with GPT's key bias (b_qkv[:, 1]) removed; see the module docstring.

    Llama's key bias (b_kv[0]) is rotated with each key's position before the dot product, so
    it does not cancel in the softmax: it has a real gradient and is compared.
    """
    params = jax.tree.map(np.asarray, params)
    if 'b_qkv' in params['blocks']['attn']:
        params['blocks']['attn']['b_qkv'] = params['blocks']['attn']['b_qkv'][:, (0, 2)]
    return params


def check_against_reference(result, reference):
    loss, grads, params = result
    ref_loss, ref_grads, ref_params = reference
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    assert_trees_close(grads, ref_grads, 'grad')
    if 'b_qkv' in grads['blocks']['attn']:
        key_bias_grad = grads['blocks']['attn']['b_qkv'][:, 1]
        assert np.max(np.abs(key_bias_grad)) < 1e-6, 'the key bias gradient must vanish'
    assert_trees_close(without_key_bias(params), without_key_bias(ref_params), 'param after 3 steps')


def assert_trees_close(actual, expected, what):
    flat_a = jax.tree_util.tree_leaves_with_path(actual)
    flat_e = jax.tree.leaves(expected)
    assert len(flat_a) == len(flat_e)
    for (path, a), e in zip(flat_a, flat_e):
        np.testing.assert_allclose(a, e, rtol=TREE_RTOL, atol=TREE_ATOL,
                                   err_msg=f'{what} {jax.tree_util.keystr(path)}')


