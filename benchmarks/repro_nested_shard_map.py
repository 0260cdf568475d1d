"""Does this jax compile a shard_map over `pipeline` nested in one over `data`? (docs/PERFORMANCE.md)

  python benchmarks/repro_nested_shard_map.py        # prints "ok" or XLA aborts the process

jax 0.10.x: ok. jax 0.11.2 (Shardy): XLA aborts with "Manual axes must be sorted by mesh axis
index" -- the nesting the pipelined train step used with the data-local gradient reduction
until pipeline.make_pipeline_grads made it one map manual over {pipeline, data}. Kept to show
why, and to tell when a jax accepts the nesting again.
"""

import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, PartitionSpec as P  # noqa: E402


def main() -> None:
    mesh = jax.make_mesh((2, 2, 1, 2), ('pipeline', 'data', 'fsdp', 'tensor'), axis_types=(AxisType.Auto,) * 4)

    def per_data_replica(x):
        y = jax.shard_map(lambda a: jax.lax.psum(a, 'pipeline'), in_specs=P('pipeline'), out_specs=P(),
                          axis_names={'pipeline'}, check_vma=False)(x)
        return jax.lax.psum(y, 'data')

    with jax.set_mesh(mesh):
        f = jax.jit(jax.shard_map(per_data_replica, in_specs=P('data'), out_specs=P(), axis_names={'data'},
                                  check_vma=False))
        f(jnp.ones((8, 4))).block_until_ready()
    print(f'ok: jax {jax.__version__} compiles a pipeline shard_map nested in a data shard_map')


if __name__ == '__main__':
    main()
