"""The ragged all-to-all (model/layers/ragged.py): the CPU stand-in has the op's documented semantics, and
a program lowered for cuda or rocm from this CPU machine holds the real op (XLA:CPU has none)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxfrontier.model.layers import ragged

# jax.lax.ragged_all_to_all's docstring example (axis of size 2).
OPERAND = [[1, 2, 2], [3, 4, 0]]
INPUT_OFFSETS, SEND_SIZES = [[0, 1], [0, 1]], [[1, 2], [1, 1]]
OUTPUT_OFFSETS, RECV_SIZES = [[0, 0], [1, 2]], [[1, 1], [2, 1]]


def _program():
    mesh = jax.make_mesh((2,), ('e',), axis_types=(jax.sharding.AxisType.Auto,))
    body = lambda *a: ragged.ragged_all_to_all(*(x[0] for x in a), axis_name='e')[None]  # noqa: E731
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P('e'),) * 6, out_specs=P('e'), check_vma=False))
    args = (jnp.asarray(OPERAND, jnp.float32), jnp.zeros((2, 4), jnp.float32),
            *(jnp.asarray(a, jnp.int32) for a in (INPUT_OFFSETS, SEND_SIZES, OUTPUT_OFFSETS, RECV_SIZES)))
    return fn, args


def test_stand_in_gives_the_documented_result_and_gradient():
    fn, args = _program()
    np.testing.assert_array_equal(fn(*args), [[1, 3, 0, 0], [2, 2, 4, 0]])
    weights = jnp.arange(8.0).reshape(2, 4)
    grad = jax.grad(lambda o: jnp.sum(fn(o, *args[1:]) * weights))(args[0])
    # Row r of sender s lands at (device, slot): its gradient is that slot's weight; an unsent row gets 0.
    np.testing.assert_array_equal(grad, [[0, 4, 5], [1, 6, 0]])


def test_gpu_lowering_holds_the_real_op_and_the_cpu_program_does_not():
    fn, args = _program()
    traced = fn.trace(*args)
    for platform in ragged.PLATFORMS_WITH_OP:
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert 'ragged_all_to_all' in text, platform
    assert not re.search('ragged_all_to_all', fn.lower(*args).as_text())
