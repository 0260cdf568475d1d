"""GPU defaults: model.scan_unroll=0 (auto) unrolls every layer on GPUs and keeps the CPU's rolled scan."""

import jax
import pytest

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.errors import ConfigError
from jaxfrontier.training import state as ts


@pytest.mark.parametrize('platform, expected', [('gpu', 12), ('cuda', 12), ('rocm', 12), ('cpu', 1), (None, 1)])
def test_auto_scan_unroll_per_platform(platform, expected):
    c = config_lib.base_config()
    c.model.num_layers = 12
    assert c.model.scan_unroll == 0  # auto is the default
    assert config_lib.model_shape(c, platform).scan_unroll == expected
    c.model.scan_unroll = 3  # an explicit value wins everywhere
    assert config_lib.model_shape(c, platform).scan_unroll == 3


def test_trainer_resolves_auto_from_the_mesh_devices():
    c = config_lib.base_config()
    layout = ts.make_placement(c, mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:1]))
    assert layout.model_def.bind(layout.model_def.abstract_params()).shape.scan_unroll == (c.model.num_layers if jax.default_backend() == 'gpu' else 1)


def test_negative_scan_unroll_is_refused():
    c = config_lib.base_config()
    c.model.scan_unroll = -1
    with pytest.raises(ConfigError, match='model.scan_unroll'):
        config_lib.validate(c, 1)
