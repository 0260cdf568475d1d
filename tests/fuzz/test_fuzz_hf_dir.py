"""Fuzz: Hugging Face model directories (config.json + model.safetensors) for init_params_from.

Two pristine directories, a GPT-2 and a Llama (grouped-query attention, Llama 3.1 RoPE, untied
head), each mutated in its config and its weights; the family is chosen from config.json.
"""

import json
import math
import os
import pathlib
import shutil
import tempfile

import numpy as np
from hypothesis import strategies as st
from safetensors.numpy import save_file

from fuzzing import fuzz, json_values, mutated_bytes, mutated_dict, snapshot, tiers, user_error_or
from jaxfrontier.checkpoint.interop import hf_files as hf_dir
from jaxfrontier.checkpoint.interop import hf
from test_hostile_inputs import hf_directory

LLAMA = {'model_type': 'llama', 'architectures': ['LlamaForCausalLM'], 'hidden_size': 16, 'intermediate_size': 24,
         'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'vocab_size': 64,
         'max_position_embeddings': 32, 'rms_norm_eps': 1e-5, 'hidden_act': 'silu', 'tie_word_embeddings': False,
         'rope_parameters': {'rope_type': 'llama3', 'rope_theta': 500000.0, 'factor': 8.0, 'low_freq_factor': 1.0,
                             'high_freq_factor': 4.0, 'original_max_position_embeddings': 16}}


def llama_directory(path):
    rng = np.random.RandomState(0)
    tensors = {('' if name == 'lm_head.weight' else 'model.') + name: (0.02 * rng.randn(*shape)).astype(np.float32)
               for name, shape in hf_dir.expected_shapes(LLAMA).items()}
    path.mkdir(parents=True, exist_ok=True)
    (path / 'config.json').write_text(json.dumps(LLAMA))
    save_file(tensors, str(path / 'model.safetensors'))
    return path


def sharded(path, source):
    """`source`'s tensors in two shards and model.safetensors.index.json, as save_pretrained writes a large model."""
    from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
    tensors = load_file(str(source / 'model.safetensors'))
    names = sorted(tensors)
    path.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source / 'config.json', path / 'config.json')
    weight_map = {}
    for i, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
        file = f'model-0000{i + 1}-of-00002.safetensors'
        save_file({n: tensors[n] for n in part}, str(path / file))
        weight_map |= {n: file for n in part}
    (path / hf_dir.INDEX).write_text(json.dumps({'metadata': {}, 'weight_map': weight_map}))
    return path


_ROOT = pathlib.Path(tempfile.mkdtemp(prefix='jf_fuzz_hf_'))
PRISTINE = {'gpt2': hf_directory(_ROOT / 'gpt2', layers=2), 'llama': llama_directory(_ROOT / 'llama')}
CONFIG = {k: json.loads((p / 'config.json').read_text()) for k, p in PRISTINE.items()}
WEIGHTS = {k: (p / 'model.safetensors').read_bytes() for k, p in PRISTINE.items()}
SHARDED = sharded(_ROOT / 'sharded', PRISTINE['llama'])
INDEX = json.loads((SHARDED / hf_dir.INDEX).read_text())


def cases_of(kind):
    config, weights = CONFIG[kind], WEIGHTS[kind]
    configs = st.one_of(mutated_dict(config).map(lambda c: json.dumps(c, allow_nan=True).encode()),
                        mutated_bytes(json.dumps(config).encode()), json_values.map(lambda v: json.dumps(v).encode()))
    data = st.one_of(st.just(weights), mutated_bytes(weights[:4096]).map(lambda head: head + weights[4096:]),
                     mutated_bytes(weights), st.none())
    return st.tuples(configs, data)


# What an accepted directory gives: positive integers, and for Llama positive finite numbers.
INTS = {'gpt': ('num_layers', 'd_model', 'num_heads', 'vocab_size', 'mlp_ratio', 'seq_len'),
        'llama': ('num_layers', 'd_model', 'num_heads', 'num_kv_heads', 'vocab_size', 'mlp_dim', 'seq_len')}
NUMBERS = ('norm_eps', 'rope_theta', 'rope_factor', 'rope_low_freq_factor', 'rope_high_freq_factor')


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
            if isinstance(out, dict):  # accepted: the fields our model needs
                assert all(isinstance(out[k], int) and out[k] > 0 for k in INTS[out['family']])
                assert all(0 < out[k] < math.inf for k in NUMBERS if k in out)
                if out['family'] == 'llama':
                    assert out['d_model'] % out['num_heads'] == 0 and out['num_heads'] % out['num_kv_heads'] == 0
        assert snapshot(d) == before


@tiers(fast=100)
def test_hf_directory(budget):
    fuzz('Hugging Face GPT-2 directory (hf_dir + model_fields)', cases_of('gpt2'), check, budget,
         examples=[(json.dumps(CONFIG['gpt2'] | {'n_inner': 'x'}).encode(), WEIGHTS['gpt2']),
                   (json.dumps(CONFIG['gpt2'] | {'layer_norm_epsilon': None}).encode(), WEIGHTS['gpt2']),
                   (json.dumps(CONFIG['gpt2'] | {'n_embd': 33}).encode(), WEIGHTS['gpt2']),
                   (json.dumps(CONFIG['gpt2'] | {'n_layer': 10**12}).encode(), WEIGHTS['gpt2'])])


@tiers(fast=100)
def test_hf_llama_directory(budget):
    llama, weights = CONFIG['llama'], WEIGHTS['llama']
    fuzz('Hugging Face Llama directory (hf_dir + model_fields)', cases_of('llama'), check, budget,
         examples=[(json.dumps(llama | {'num_hidden_layers': 10**12}).encode(), weights),
                   (json.dumps(llama | {'rope_parameters': {'rope_type': 'llama3'}}).encode(), weights),
                   (json.dumps(llama | {'rope_parameters': 'x', 'rope_scaling': 3}).encode(), weights),
                   (json.dumps(llama | {'num_key_value_heads': 3}).encode(), weights),
                   (json.dumps(llama | {'head_dim': 0}).encode(), weights),
                   (json.dumps(llama | {'rms_norm_eps': float('nan')}, allow_nan=True).encode(), weights),
                   (json.dumps(llama | {'model_type': None}).encode(), weights),
                   (json.dumps({k: v for k, v in llama.items() if k != 'model_type'}).encode(), weights),
                   (json.dumps({k: v for k, v in llama.items() if k != 'model_type'} | {'architectures': [[]]})
                    .encode(), weights)])


def check_index(index: bytes):
    """A sharded directory whose index is mutated: one line, or the same tensors as the intact one."""
    with tempfile.TemporaryDirectory() as d:
        for f in os.listdir(SHARDED):
            shutil.copyfile(SHARDED / f, os.path.join(d, f))
        with open(os.path.join(d, hf_dir.INDEX), 'wb') as f:
            f.write(index)
        before = snapshot(d)
        out = user_error_or(lambda: hf_dir.check(d))
        if isinstance(out, tuple):
            assert all(os.path.dirname(t.file) == d for t in out[1].values())  # nothing read outside it
            assert set(out[1]) <= set(INDEX['weight_map'])
        assert snapshot(d) == before


@tiers(fast=100)
def test_hf_sharded_index(budget):
    indexes = st.one_of(mutated_dict(INDEX).map(lambda c: json.dumps(c, allow_nan=True).encode()),
                        mutated_bytes(json.dumps(INDEX).encode()), json_values.map(lambda v: json.dumps(v).encode()))
    first = sorted(INDEX['weight_map'])[0]
    mapped = lambda file: json.dumps({'weight_map': INDEX['weight_map'] | {first: file}}).encode()  # noqa: E731
    fuzz('Hugging Face shard index (hf_dir.weights)', indexes, check_index, budget,
         examples=[mapped('../model-00001-of-00002.safetensors'), mapped('/etc/passwd'),
                   mapped('model-00002-of-00002.safetensors'), mapped('missing.safetensors'),
                   json.dumps({'weight_map': []}).encode(), b'[]'])


def teardown_module():
    shutil.rmtree(_ROOT, ignore_errors=True)
