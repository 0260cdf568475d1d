"""Config: the schema (`schema.py`), the mesh axes' table (`axes.py`), validation (`checks.py`) and the sharding rules fitted to a model and mesh (`rules.py`); this module is the front door.

Every `configs/*.py` file starts from `base_config()` and changes only what differs. All
rules a config must satisfy are checked by `validate` before JAX compiles anything; a broken
rule raises `ConfigError`, whose message names the field, its value and the fix.

No module here imports JAX: `main` reads the config before JAX starts, so that it can set
the simulated CPU device count.
"""

from jaxfrontier.config import axes  # noqa: F401  (the mesh axes' table: config.axes.AXES)
from jaxfrontier.config.axes import AXES, Axis  # noqa: F401
from jaxfrontier.config.checks import check_compiles, check_device_count, validate  # noqa: F401
from jaxfrontier.config.rules import SEQUENCE_PARALLEL, resolve_rules, sequence_parallel, sharding_rules  # noqa: F401
from jaxfrontier.config.schema import (  # noqa: F401
    ATTENTION_IMPLS,
    DATA_KINDS,
    DEFAULT_RULES,
    DISTRIBUTED_MODES,
    DTYPES,
    GPU_PLATFORMS,
    LOSS_SCALES,
    MESH_AXES,
    MODEL_FAMILIES,
    MODEL_SIZES,
    OPTIMIZERS,
    LR_SCHEDULES,
    ModelShape,
    PIPELINE_SCHEDULES,
    REMAT_POLICIES,
    STAGGERED_RESIDUALS,
    base_config,
    compile_cache_dir,
    data_cache_dir,
    data_parallel_size,
    flops_per_step,
    lora_dropout,
    mesh_shape,
    mlp_dim,
    model_mlp_dim,
    model_shape,
    model_size_config,
    num_devices,
    padded_vocab,
    parse_arg,
    resolve_fast_dir,
    resolve_scan_unroll,
    set_cpu_device_count,
)
