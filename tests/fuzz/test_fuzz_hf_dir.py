"""Fuzz: Hugging Face GPT-2 directories (config.json + model.safetensors) for init_params_from."""

import json
import os
import shutil
import tempfile

from hypothesis import strategies as st

from fuzzing import fuzz, json_values, mutated_bytes, mutated_dict, snapshot, tiers, user_error_or
from jaxfrontier.checkpoint import hf_files as hf_dir
from jaxfrontier.checkpoint import hf
from test_hostile_inputs import hf_directory

_ROOT = tempfile.mkdtemp(prefix='jf_fuzz_hf_')
PRISTINE = hf_directory(__import__('pathlib').Path(_ROOT) / 'hf', layers=2)
CONFIG = json.loads((PRISTINE / 'config.json').read_text())
WEIGHTS = (PRISTINE / 'model.safetensors').read_bytes()

configs = st.one_of(mutated_dict(CONFIG).map(lambda c: json.dumps(c, allow_nan=True).encode()),
                    mutated_bytes(json.dumps(CONFIG).encode()), json_values.map(lambda v: json.dumps(v).encode()))
weights = st.one_of(st.just(WEIGHTS), mutated_bytes(WEIGHTS[:4096]).map(lambda head: head + WEIGHTS[4096:]),
                    mutated_bytes(WEIGHTS), st.none())
cases = st.tuples(configs, weights)


def check(case):
    config, data = case
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, 'config.json'), 'wb') as f:
            f.write(config)
        if data is not None:
            with open(os.path.join(d, 'model.safetensors'), 'wb') as f:
                f.write(data)
        before = snapshot(d)
        assert hf_dir.looks_like_hf(d) == (data is not None or b'model_type' in config) or data is None
        if hf_dir.looks_like_hf(d):
            out = user_error_or(lambda: hf.model_fields(hf_dir.check(d)[0], d))
            if isinstance(out, dict):  # accepted: the fields our model needs, positive integers
                assert all(isinstance(out[k], int) and out[k] > 0 for k in ('num_layers', 'd_model', 'num_heads',
                                                                              'vocab_size', 'mlp_ratio', 'seq_len'))
        assert snapshot(d) == before


@tiers(fast=100)
def test_hf_directory(budget):
    fuzz('Hugging Face directory (hf_dir + model_fields)', cases, check, budget,
         examples=[(json.dumps(CONFIG | {'n_inner': 'x'}).encode(), WEIGHTS),
                   (json.dumps(CONFIG | {'layer_norm_epsilon': None}).encode(), WEIGHTS),
                   (json.dumps(CONFIG | {'n_embd': 33}).encode(), WEIGHTS)])


def teardown_module():
    shutil.rmtree(_ROOT, ignore_errors=True)
