"""The mesh axes' table (config/axes.py): its rules, and that its consumers derive from it.

The last test adds a row (tests/axes_with_row.py) and follows it through the config section and checks,
Layout, the mesh, the sweep space, the saved checkpoint meta, the planner and decoding: adding an axis is
one row plus the code that uses it.
"""

import dataclasses
import os
import subprocess
import sys

import pytest

from jaxfrontier import config as config_lib
from jaxfrontier import layout as layout_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.checkpoint import saved_meta
from jaxfrontier.config import axes as axes_lib
from jaxfrontier.plan import measured, shrink
from jaxfrontier.sweep import space

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Axis = axes_lib.Axis


def test_the_table():
    """Mesh order outermost to innermost (tensor on the nearest devices), one role each, data the replica axis."""
    assert config_lib.MESH_AXES == ('pipeline', 'data', 'fsdp', 'expert', 'context', 'tensor')
    assert {a.name: a.role for a in axes_lib.AXES} == {'pipeline': 'pipeline', 'data': 'batch', 'fsdp': 'batch',
                                                       'expert': 'batch', 'context': 'sequence', 'tensor': 'model'}
    assert axes_lib.replica().name == 'data' and [a.name for a in axes_lib.AXES if a.shards_params] == ['fsdp']
    assert [a.name for a in axes_lib.AXES if a.holds_experts] == ['expert']  # not a replica: it holds experts
    assert [a.name for a in axes_lib.AXES if a.optional] == ['expert', 'context']  # older checkpoints lack them
    assert axes_lib.get('fsdp').field == 'mesh.fsdp'
    assert [a.name for a in axes_lib.of_role('batch')] == ['data', 'fsdp', 'expert']
    assert axes_lib.data_parallel({'data': 2, 'fsdp': 3, 'expert': 7, 'tensor': 5}) == 42
    assert axes_lib.product({'data': 2, 'tensor': 5}) == 10
    # The expert axis is in the mesh only where it is larger than 1: dense programs are those from before it.
    assert [a.name for a in axes_lib.AXES if a.dropped_at_1] == ['expert']
    assert axes_lib.in_mesh({'data': 8}) == ('pipeline', 'data', 'fsdp', 'context', 'tensor')
    assert axes_lib.in_mesh({'expert': 2}) == config_lib.MESH_AXES


@pytest.mark.parametrize('table, problem', [
    (axes_lib.AXES + (Axis('tensor', 'model', 'again'),), 'named twice'),
    (axes_lib.AXES + (Axis('experts2', 'experts', 'a role nobody knows'),), 'role outside'),
    (axes_lib.AXES + (Axis('replicas', 'batch', 'a second replica axis'),), 'exactly one'),
    (tuple(a for a in axes_lib.AXES if a.name != 'data'), 'exactly one'),
])
def test_a_wrong_row_is_refused(table, problem):
    with pytest.raises(ValueError, match=problem):
        axes_lib.check_table(table)


def test_consumers_list_the_table():
    """Each list of axes a consumer keeps is the table's (the order where it matters)."""
    names = config_lib.MESH_AXES
    assert set(config_lib.base_config().mesh) == {*names, 'cpu_devices'}
    assert tuple(f.name for f in dataclasses.fields(layout_lib.MeshSizes)) == names
    assert tuple(layout_lib.Layout().mesh_shape) == names
    assert mesh_lib.make_mesh({'data': 4, 'expert': 2}).axis_names == names
    assert mesh_lib.make_mesh({'data': 8}).axis_names == tuple(n for n in names if n != 'expert')  # dropped at 1
    others = tuple(a.name for a in axes_lib.AXES if a.name != 'data')
    assert tuple(n for n in space.PARAMS if n in names) == others and 'mesh.data' in space.DERIVED
    assert saved_meta.POSITIVE_MESH_FIELDS + saved_meta.OPTIONAL_MESH_FIELDS == ('pipeline', 'data', 'fsdp', 'tensor',
                                                                                  'expert', 'context')
    assert tuple(f for f in shrink.KEPT if f.startswith('mesh.')) == tuple(f'mesh.{n}' for n in others)
    assert {n: measured.LAYOUT_FIELDS[n] for n in names} == {n: f'mesh.{n}' for n in names}


def _axes(target):
    return mesh_lib.entry_axes(target)


def test_the_default_rules_follow_the_roles():
    """The default logical rules put each logical dimension on the axes of its role: the batch on every
    batch axis, the tokens on the sequence axes then the batch axes, every weight's model dimension on
    the axes that shard parameters, the stacked layers on the pipeline."""
    rules = dict(config_lib.DEFAULT_RULES)
    names = lambda axes: tuple(a.name for a in axes)
    assert _axes(rules['batch']) == names(axes_lib.of_role('batch'))
    assert _axes(rules['length']) == names(axes_lib.of_role('sequence'))
    assert _axes(rules['tokens']) == names(axes_lib.of_role('sequence') + axes_lib.of_role('batch'))
    assert _axes(rules['embed']) == tuple(a.name for a in axes_lib.AXES if a.shards_params)
    assert _axes(rules['layers']) == names(axes_lib.of_role('pipeline'))
    assert _axes(rules['experts']) == tuple(a.name for a in axes_lib.AXES if a.holds_experts)
    assert _axes(rules['expert_mlp']) == names(axes_lib.of_role('model'))
    for logical in ('mlp', 'heads', 'kv_heads', 'vocab'):
        assert _axes(rules[logical]) == names(axes_lib.of_role('model'))


@pytest.mark.parametrize('row, before', [
    # A second model axis (MaxText's tensor_sequence), missing from older checkpoints.
    ("Axis('tensor_sequence', 'model', 'a second tensor axis', optional=True)", 'tensor'),
    # MaxText's second FSDP axis: it splits the batch and shards the parameters.
    ("Axis('fsdp_transpose', 'batch', 'a second ZeRO-3 axis', shards_params=True)", 'context'),
])
def test_a_new_row_reaches_every_consumer(row, before):
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS='cpu')
    proc = subprocess.run([sys.executable, os.path.join(REPO, 'tests', 'axes_with_row.py'), row, before],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith('ok'), proc.stdout + proc.stderr
