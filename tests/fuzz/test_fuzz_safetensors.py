"""Fuzz: safetensors files, through our header check (hf_dir) and the init_params_from reader (export)."""

import json
import os
import struct
import tempfile

import numpy as np
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import save_file

from fuzzing import fuzz, json_values, mutated_bytes, mutated_dict, snapshot, tiers, user_error_or
from jaxfrontier.checkpoint.interop import hf_files as hf_dir
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.checkpoint.interop import init_from
from jaxfrontier.checkpoint import readers
from jaxfrontier.checkpoint import target as target_lib
from jaxfrontier.training import state as ts
from test_hostile_finite import tiny_config, write_params


def _small_file() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, 'f.safetensors')
        save_file({'a': np.arange(6, dtype=np.float32).reshape(2, 3), 'b': np.ones(4, np.float16)}, path,
                  metadata={'format': 'pt'})
        with open(path, 'rb') as f:
            return f.read()


SMALL = _small_file()
HEADER = json.loads(SMALL[8:8 + int.from_bytes(SMALL[:8], 'little')])


def with_header(header: dict, data: bytes = SMALL[8 + int.from_bytes(SMALL[:8], 'little'):]) -> bytes:
    raw = json.dumps(header, allow_nan=True).encode()
    return struct.pack('<Q', len(raw)) + raw + data


entries = st.fixed_dictionaries({}, optional={'dtype': st.one_of(st.sampled_from(sorted(hf_dir.ITEMSIZE)), json_values),
                                              'shape': st.one_of(st.lists(st.integers(-2, 6), max_size=3), json_values),
                                              'data_offsets': st.one_of(st.lists(st.integers(-4, 80), max_size=3),
                                                                        json_values)})
files = st.one_of(
    mutated_bytes(SMALL),
    mutated_dict(HEADER).map(with_header),
    st.dictionaries(st.text(max_size=5), entries, max_size=3).map(with_header),
    st.binary(max_size=64),
    st.integers(0, 2**64 - 1).map(lambda n: struct.pack('<Q', n) + b'{}'),
)


def check_header(data: bytes):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, 'f.safetensors')
        with open(path, 'wb') as f:
            f.write(data)
        before = snapshot(d)
        out = user_error_or(lambda: hf_dir.read_safetensors_header(path))
        assert snapshot(d) == before
        if isinstance(out, dict):  # accepted: the library reads every tensor we listed, in that shape, as we do
            entries = hf_dir.read_safetensors_entries(path)
            with safe_open(path, framework='numpy') as f:
                for name, (dtype, shape) in out.items():
                    if dtype in hf_dir.READABLE:
                        ours = hf_dir.read_tensor(entries[name])
                        assert ours.shape == shape
                        if dtype != 'BF16':  # numpy has no bfloat16: the library cannot read it this way
                            np.testing.assert_array_equal(ours, f.get_tensor(name).astype(np.float32))


@tiers(fast=150)
def test_safetensors_header(budget):
    fuzz('safetensors header (hf_dir)', files, check_header, budget,
         examples=[struct.pack('<Q', 2**63) + b'{}', with_header({'a': {'dtype': 'F32', 'shape': [2, 3],
                                                                       'data_offsets': [0, 99]}})])


# --------------------------------------------------------------------------- init_params_from=<file.safetensors>

C = tiny_config()
LAYOUT = None


def _ours() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = write_params(os.path.join(d, 'p.safetensors'), C)
        with open(path, 'rb') as f:
            return f.read()


def check_load(data: bytes):
    global LAYOUT  # pylint: disable=global-statement  (one layout for every input)
    LAYOUT = LAYOUT or ts.make_placement(C, mesh_lib.mesh_from_config(C))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, 'p.safetensors')
        with open(path, 'wb') as f:
            f.write(data)
        before = snapshot(d)
        out = user_error_or(lambda: init_from.load_params(path, C, target_lib.abstract_target(LAYOUT.abstract_state['params'], LAYOUT.param_shardings)))
        assert snapshot(d) == before
        if isinstance(out, dict):  # accepted: every parameter in the layout's shape
            got = {k: v.shape for k, v in readers.flatten_names(out).items()}
            want = {k: v.shape for k, v in readers.flatten_names(LAYOUT.abstract_state['params']).items()}
            assert got == want


def ours_mutated():
    data = _ours()
    n = int.from_bytes(data[:8], 'little')
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    meta = {'format': 'jaxfrontier-params', 'config': json.dumps({'model': {'num_layers': 1}})}
    return st.one_of(
        mutated_bytes(data[:8 + n + 64]).map(lambda head: head + body[64:]),  # damage in the header
        mutated_bytes(data),
        mutated_dict(header).map(lambda h: with_header(h, body)),
        st.one_of(json_values.map(lambda v: json.dumps(v)), st.text(max_size=30)).map(
            lambda cfg: with_header(header | {'__metadata__': meta | {'config': cfg}}, body)),
    )


@tiers(fast=40, slow=400)
def test_init_params_from_safetensors(budget):
    fuzz('init_params_from=<file.safetensors>', ours_mutated(), check_load, budget, deadline_ms=10_000)
