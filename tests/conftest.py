"""Test setup: 8 simulated CPU devices, set before JAX starts; the `slurm` cluster fixture."""

import os

os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

from slurm_cluster import slurm  # noqa: E402,F401  (a loopback Slurm cluster, for any test that asks)
