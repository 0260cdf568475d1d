"""Decoding with a KV cache, sampling rules, evaluation windows, --mode=sample's mesh and errors."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.errors import UserError
from jaxfrontier.inference import evaluate
from jaxfrontier.inference import generate as gen
from jaxfrontier.inference import sample
from jaxfrontier.model.params import ModelDef, init_params
from jaxfrontier.training import state as ts
import processes

# Prime-ish sizes so a swapped axis fails: 3 layers, 4 heads of 8, 40 positions, 259 tokens (padded).
SHAPE = dict(num_layers=3, d_model=32, num_heads=4, seq_len=40, vocab_size=259)


# The Llama case: 2 kv heads for 4 query heads (the cache holds 2), q/k/v biases, RoPE.
FAMILIES = {'gpt': {}, 'llama': dict(family='llama', num_kv_heads=2, qkv_bias=True, mlp_dim=48)}


def small_config(data=1, fsdp=1, tensor=1, family='gpt'):
    c = config_lib.base_config()
    c.model.update(dtype='float32', remat='none', attention='reference', **SHAPE, **FAMILIES[family])
    c.mesh.update(data=data, fsdp=fsdp, tensor=tensor)
    return c


def sharp_params(c, seed=1):
    """Random parameters scaled up so greedy choices are far from ties."""
    params = init_params(config_lib.model_shape(c), jax.random.key(seed))
    return jax.tree.map(lambda a: a * 8 if a.ndim >= 2 else a, params)


def prompts():
    rng = np.random.RandomState(0)
    encoded = [rng.randint(0, 259, n).tolist() for n in (7, 3, 11)]
    return sample.batch_prompts(encoded, 1)


@pytest.mark.parametrize('family', ['gpt', pytest.param('llama', marks=pytest.mark.slow)])  # fast tier: one family
@pytest.mark.parametrize('rule', [gen.Sampling(0.0), pytest.param(gen.Sampling(0.8, top_k=7, top_p=0.9,
                                                                                repetition_penalty=1.3),
                                                                   marks=pytest.mark.slow)], ids=['greedy', 'top'])
def test_kv_cache_equals_recomputing_the_prefix(rule, family):
    """The cached decode picks the same tokens as re-running the whole sequence every step."""
    c = small_config(family=family)
    model_def, params = ModelDef.create(config_lib.model_shape(c)), sharp_params(c)
    prompt_bp, lengths_b = prompts()
    key = jax.random.key(3)
    cached = gen.make_generate(model_def, max_new=8, rule=rule)(params, prompt_bp, lengths_b, key)
    full = gen.make_generate(model_def, max_new=8, rule=rule, cached=False)(params, prompt_bp, lengths_b, key)
    np.testing.assert_array_equal(np.asarray(cached), np.asarray(full))
    assert len(np.unique(np.asarray(cached))) > 3  # not a degenerate constant stream


def test_next_token_rules():
    logits = jnp.array([[0.0, 5.0, 4.0, 3.0, 9.0]])  # index 4 is vocabulary padding (real vocab 4)
    assert int(gen.next_token(logits, jax.random.key(0), gen.Sampling(0.0), 4)[0]) == 1
    draws = {int(gen.next_token(logits, jax.random.key(i), gen.Sampling(1.0, top_k=2), 4)[0]) for i in range(64)}
    assert draws == {1, 2}
    # top_p 0.5: token 1 alone has p = 0.66 of the real vocabulary, so it is the whole nucleus
    draws = {int(gen.next_token(logits, jax.random.key(i), gen.Sampling(1.0, top_p=0.5), 4)[0]) for i in range(64)}
    assert draws == {1}


def test_eval_windows_score_every_token_once():
    tokens = np.arange(103)
    rows = list(evaluate.windows(tokens, 0, 103, 10))
    scored = np.concatenate([row[1:n + 1] for row, n in rows])
    np.testing.assert_array_equal(scored, np.arange(1, 103))
    rows = list(evaluate.windows(tokens, 50, 103, 10))  # a validation split: its own first token is context
    np.testing.assert_array_equal(np.concatenate([row[1:n + 1] for row, n in rows]), np.arange(51, 103))


@pytest.mark.slow
@pytest.mark.parametrize('family', FAMILIES)
def test_greedy_tokens_on_the_tiny_mesh_equal_one_device(family):
    """data 2 x fsdp 2 x tensor 2 (heads, kv heads and vocabulary split over tensor) decodes as one device does."""
    one = small_config(family=family)
    model_def, params = ModelDef.create(config_lib.model_shape(one)), sharp_params(one)
    prompt_bp, lengths_b = sample.batch_prompts([[5, 6, 7], [250, 1], [9, 9, 9, 9], [3]], 4)
    rule, key = gen.Sampling(0.0), jax.random.key(0)
    expected = gen.make_generate(model_def, max_new=10, rule=rule)(params, prompt_bp, lengths_b, key)

    c = small_config(data=2, fsdp=2, tensor=2, family=family)  # vocabulary padded to 512 here, 384 above
    layout = ts.make_placement(c, mesh_lib.mesh_from_config(c))
    vp = config_lib.padded_vocab(c)
    padded = {**params, 'wte': jnp.zeros((vp, 32)).at[:params['wte'].shape[0]].set(params['wte'])}
    with jax.set_mesh(layout.mesh), mesh_lib.use_rules(layout.rules):
        placed = jax.device_put(padded, layout.param_shardings)
        batch = NamedSharding(layout.mesh, mesh_lib.batch_spec(layout.rules))
        run = gen.make_generate(layout.model_def, max_new=10, rule=rule)
        got = run(placed, jax.device_put(prompt_bp, batch), lengths_b, key)
        hlo = run.lower(placed, jax.device_put(prompt_bp, batch), lengths_b, key).compile().as_text()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert 'all-reduce' in hlo  # row-parallel projections: the heads really were split


def test_sample_without_checkpoint_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, '-m', 'jaxfrontier.main', '--config=configs/tiny.py', '--mode=sample',
                           f'--workdir={tmp_path / "empty"}', '--prompt=hi'], cwd=processes.REPO,
                          env=processes.subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert 'no checkpoint in --workdir' in proc.stderr and 'Fix:' in proc.stderr
    assert 'Traceback' not in proc.stderr


def test_prompt_longer_than_the_model_is_refused():
    with pytest.raises(UserError, match='exceeds the model'):
        sample.encode_prompts(type('C', (), {'encode': staticmethod(lambda s: [1] * len(s))})(), ['x' * 30],
                              max_new=20, seq_len=40)



@pytest.mark.slow
def test_interleaved_pipeline_checkpoint_is_regathered_for_decoding(tmp_path):
    """A checkpoint of pipeline 2 x virtual 2 ([V, L / V, ...] blocks) loads as [L, ...] on a mesh without pipeline."""
    from jaxfrontier.inference import load as load_lib  # pylint: disable=g-import-not-at-top
    from jaxfrontier.model.params import merge_virtual  # pylint: disable=g-import-not-at-top
    from jaxfrontier.checkpoint import manager as ckpt_lib  # pylint: disable=g-import-not-at-top

    c = small_config(fsdp=2, tensor=2)
    c.model.num_layers = 4
    c.mesh.pipeline, c.pipeline.virtual_stages, c.pipeline.schedule = 2, 2, 'interleaved'
    layout = ts.make_placement(c, mesh_lib.mesh_from_config(c))
    state = ts.init_train_state(c, layout)
    c.checkpoint.async_save = False
    ckpt = ckpt_lib.Checkpointer(c, str(tmp_path / 'run'))
    ckpt.save(1, state, force=True)
    ckpt.close()
    assert state['params']['blocks']['mlp']['w_in'].shape[:2] == (2, 2)

    decode_c = small_config(fsdp=2, tensor=2)  # data 2 x fsdp 2 x tensor 2 after folding the pipeline: 8 devices
    decode_c.mesh.update(pipeline=2, data=1)
    loaded = load_lib.load(decode_c, str(tmp_path / 'run'))
    assert (loaded.config.mesh.pipeline, loaded.config.mesh.data, loaded.config.model.num_layers) == (1, 2, 4)
    expected = merge_virtual(jax.device_get(state['params']))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(loaded.params), expected)
