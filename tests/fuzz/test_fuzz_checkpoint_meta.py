"""Fuzz: the JSON saved with a checkpoint step (`<step>/meta/metadata`), as export, sample, eval and
init_params_from read it (checkpoint/readers.read_meta, then the fields the readers adopt).

checkpoint_meta.json is the meta of a real step (configs/tiny.py, one layer of 32, step 1).
"""

import json
import os
import tempfile

from hypothesis import strategies as st

from fuzzing import fuzz, json_values, mutated_bytes, mutated_dict, snapshot, tiers, user_error_or
from jaxfrontier import config as config_lib
from jaxfrontier.inference import load as load_lib
from jaxfrontier.checkpoint import format as ckpt_lib
from jaxfrontier.checkpoint import readers as readers_lib

with open(os.path.join(os.path.dirname(__file__), 'checkpoint_meta.json')) as _f:
    META = json.load(_f)


def nested(meta, section):
    """Mutations of one section of the saved config."""
    return mutated_dict(meta['config'][section]).map(
        lambda sub: meta | {'config': meta['config'] | {section: sub}})


metas = st.one_of(
    mutated_dict(META).map(lambda m: json.dumps(m, allow_nan=True).encode()),
    mutated_dict(META['config']).map(lambda c: json.dumps(META | {'config': c}, allow_nan=True).encode()),
    st.sampled_from(['model', 'mesh', 'pipeline', 'data']).flatmap(lambda s: nested(META, s)).map(
        lambda m: json.dumps(m, allow_nan=True).encode()),
    mutated_bytes(json.dumps(META).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
)
step_names = st.sampled_from(['1', '0', '007', '12345678901234567890'])


def readers(meta, step_dir):
    """What the readers do with a meta read_meta accepted (load.load, export_params, load_checkpoint_params)."""
    c = config_lib.base_config()
    c.mesh.update(data=1, fsdp=1, tensor=1)
    model = meta['config']['model']
    load_lib.decode_config(c, model)
    ckpt_lib.padded_vocab_of(meta['config'])
    ckpt_lib.check_model_matches(meta['config'], c, step_dir, 'x')
    assert isinstance(meta['config']['mesh']['pipeline'] > 1 and meta['config']['pipeline']['virtual_stages'] > 1,
                      bool)
    return meta


def check(case):
    data, step = case
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, 'checkpoints', step, 'meta'))
        with open(os.path.join(d, 'checkpoints', step, 'meta', 'metadata'), 'wb') as f:
            f.write(data)
        before = snapshot(d)
        out = user_error_or(lambda: readers(readers_lib.read_meta(readers_lib.step_dir_of(d)), d))
        assert snapshot(d) == before
        if isinstance(out, dict):
            assert out['format'] == ckpt_lib.FORMAT and isinstance(out['step'], int)


@tiers(fast=150)
def test_checkpoint_meta(budget):
    fuzz('checkpoint meta (read_meta + readers)', st.tuples(metas, step_names), check, budget,
         examples=[(json.dumps(META | {'config': None}).encode(), '1'),
                   (json.dumps(META | {'config': META['config'] | {'model': {}}}).encode(), '1'),
                   (json.dumps(META | {'config': META['config'] | {'model': META['config']['model'] |
                                                                   {'num_layers': 'two'}}}).encode(), '1')])
