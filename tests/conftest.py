"""Test setup: 8 simulated CPU devices, set before JAX starts; the `slurm` cluster fixture;
the files with the most slow tests run first."""

import collections
import os

os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

from slurm_cluster import slurm  # noqa: E402,F401  (a loopback Slurm cluster, for any test that asks)


def pytest_collection_modifyitems(items):
    """Files with more slow tests first (a file's own tests keep their order).

    Under `--dist loadfile` a worker takes whole files in this order: the long files start
    early and short ones fill the end, instead of one worker finishing a long file alone.
    """
    slow = collections.Counter(item.path for item in items if item.get_closest_marker('slow'))
    items.sort(key=lambda item: -slow[item.path])
