"""`python tests/axes_with_row.py "Axis(...)" BEFORE`: jaxfrontier with one more row in the mesh axes' table,
and what each consumer of the table makes of it. Prints `ok`, or fails with an AssertionError.

The row is inserted into config/axes.py's source before axis BEFORE's row, and that table is the one every
jaxfrontier module imports (it is in sys.modules before `jaxfrontier.config` is). The table is read at
import (MESH_AXES, Layout's fields, the sweep's knobs), so tests/test_axes.py runs this in a process of its own.
"""

import importlib.util
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def load_table(row: str, before: str):
    """config/axes.py with `row` added before axis `before`'s row, registered as jaxfrontier.config.axes."""
    path = REPO / 'jaxfrontier' / 'config' / 'axes.py'
    source = path.read_text()
    anchor = f"    Axis('{before}',"
    assert source.count(anchor) == 1, anchor
    spec = importlib.util.spec_from_loader('jaxfrontier.config.axes', loader=None, origin=str(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    exec(compile(source.replace(anchor, f'    {row},\n{anchor}'), str(path), 'exec'), module.__dict__)
    return module


def raises(fn, *texts: str) -> None:
    """`fn()` fails with a one-line UserError holding every text."""
    from jaxfrontier.errors import UserError
    try:
        fn()
    except UserError as e:
        assert all(t in str(e) for t in texts) and '\n' not in str(e), (texts, str(e))
        return
    raise AssertionError(f'no error naming {texts}')


def check_config(new, config_lib) -> None:
    """The mesh section, its checks, the data-parallel size and the device count."""
    c = config_lib.base_config()
    assert c.mesh[new.name] == 1 and set(c.mesh) == {*config_lib.MESH_AXES, 'cpu_devices'}
    c.mesh[new.name] = 0
    raises(lambda: config_lib.validate(c), f'config.{new.field} = 0', 'integers >= 1')
    c.mesh[new.name] = 2
    batch = new.role == 'batch'
    if batch:  # a batch axis splits the rows: the global batch follows
        present = config_lib.axes.in_mesh(dict(c.mesh))  # an axis left out at size 1 (expert) is not named
        batch_fields = ' x '.join(a.field for a in config_lib.axes.of_role('batch') if a.name in present)
        raises(lambda: config_lib.validate(c), 'train.global_batch', f'{batch_fields} = 2')
        c.train.global_batch *= 2
    assert config_lib.data_parallel_size(c) == (2 if batch else 1)
    config_lib.validate(c, 2)
    raises(lambda: config_lib.validate(c, 1), 'needs 2 devices', f'{new.name} 2')
    if new.shards_params:
        c.mesh[new.name], c.train.global_batch = 3, 24
        raises(lambda: config_lib.validate(c), f'divisible by {new.field} = 3')
    rules = config_lib.base_config()
    rules.sharding.rules = (('mlp', new.name),)
    config_lib.validate(rules)  # a rule may name the new axis


def two(config_lib, **mesh):
    """A valid config of the base model on the mesh `mesh` (its batch per replica kept)."""
    c = config_lib.base_config()
    c.mesh.update(mesh)
    c.train.global_batch = c.train.micro_batch * config_lib.data_parallel_size(c)
    config_lib.validate(c, config_lib.num_devices(c))
    return c


def check_layout_and_mesh(new, config_lib) -> None:
    import dataclasses
    from jaxfrontier import layout as layout_lib
    from jaxfrontier import mesh as mesh_lib
    lay = layout_lib.Layout.from_config(two(config_lib, **{new.name: 2}))
    assert getattr(lay, new.name) == 2 and lay.num_devices == 2 and tuple(lay.mesh_shape) == config_lib.MESH_AXES
    assert lay.dp == (2 if new.role == 'batch' else 1) and lay.as_dict()[new.name] == 2
    assert (new.name in layout_lib.Layout().as_dict()) == (not new.optional)  # older records read the same
    assert dataclasses.replace(lay, **{new.name: 1}).num_devices == 1
    assert lay.apply(config_lib.base_config()).mesh[new.name] == 2
    mesh = mesh_lib.make_mesh({new.name: 2, 'data': 4})
    assert mesh.axis_names == config_lib.axes.in_mesh({new.name: 2}) and mesh.shape[new.name] == 2 and mesh.size == 8
    if new.role in ('batch', 'sequence'):  # the tokens' automatic axes: a pipeline's stash is not split again
        assert layout_lib.Layout(pipeline=2, tensor=2, accum_steps=2, **{new.name: 2}).split_tokens == 1


def check_sweep(new, config_lib) -> None:
    from jaxfrontier.sweep import space
    assert space.param_for(new.name).path == new.field and 'mesh.data' in space.DERIVED
    c, sets = space.point_config(config_lib.base_config(), {new.name: 2, 'accum_steps': 1}, 8,
                                 [new.name, 'accum_steps'])
    assert c.mesh.data == 4 and sets[new.field] == 2 and sets['mesh.data'] == 4
    assert space.layout_of(c)[new.name] == 2


def check_checkpoint_meta(new) -> None:
    from jaxfrontier.checkpoint import saved_meta
    meta = json.loads((REPO / 'tests' / 'fuzz' / 'checkpoint_meta.json').read_text())
    assert new.name not in meta['config']['mesh']  # written before the row
    if new.optional:
        saved_meta.check(meta, 'step 1')
    else:
        raises(lambda: saved_meta.check(meta, 'step 1'), f'config.{new.field} = None')
    meta['config']['mesh'][new.name] = 0
    raises(lambda: saved_meta.check(meta, 'step 1'), f'config.{new.field} = 0')
    meta['config']['mesh'][new.name] = 2
    saved_meta.check(meta, 'step 1')


def check_planner(new, config_lib) -> None:
    from jaxfrontier import hardware as hw_lib
    from jaxfrontier import layout as layout_lib
    from jaxfrontier.plan import compile_check, measured, preflight, search, shrink
    c = two(config_lib, **{new.name: 2, 'data': 2})
    shrunk = shrink.shrink(c)
    assert shrunk.kept[new.field] == 2 and shrunk.config.mesh[new.name] == 2
    assert shrink.reference_config(shrunk.config).mesh[new.name] == 1
    lay = layout_lib.Layout.from_config(c)
    assert f'--config.{new.field}=2' in preflight.overrides(lay)
    assert (new.field in preflight.overrides(layout_lib.Layout())) == (not new.optional)
    small = compile_check.cpu_copy(c, max_devices=2)  # shrinks data first
    assert small.mesh.data == 1 and small.mesh[new.name] == 2
    assert measured.LAYOUT_FIELDS[new.name] == new.field
    candidates = search.candidate_layouts(config_lib.base_config(), 8, hw_lib.get('mi250x'))
    assert candidates and all(getattr(x, new.name) == 1 for x in candidates)  # no sizes for it in the search


def check_decoding(new, config_lib) -> None:
    from jaxfrontier.inference import load
    decoded = load.decode_config(two(config_lib, **{new.name: 2, 'data': 2}), {})
    folded = new.role in ('pipeline', 'sequence')
    assert decoded.mesh[new.name] == (1 if folded else 2) and decoded.mesh.data == (4 if folded else 2)


def main(row: str, before: str) -> None:
    table = load_table(row, before)
    new = table.AXES[table.MESH_AXES.index(before) - 1]
    from jaxfrontier import config as config_lib
    assert config_lib.axes is table and config_lib.MESH_AXES == table.MESH_AXES
    check_config(new, config_lib)
    check_layout_and_mesh(new, config_lib)
    check_sweep(new, config_lib)
    check_checkpoint_meta(new)
    check_planner(new, config_lib)
    check_decoding(new, config_lib)
    print('ok')


if __name__ == '__main__':
    main(*sys.argv[1:])
