"""Hugging Face Qwen3 interop: QK-norm and a head width of its own, through the Llama family's converter.

`transformers` (CPU, fp32) builds tiny random `Qwen3ForCausalLM`s whose heads are not hidden_size /
num_attention_heads wide: 4 heads of 16 over a width of 48 (q 64 wide) with 2 kv heads and an untied
head, and 4 layers of heads of 8 (q 32 wide) with one kv head (replicated over tensor 2) and a tied
head; their q_norm / k_norm scales are randomized. Checked as for Llama (tests/checkpoint/test_hf_llama.py,
whose helpers these are): config.json <-> model.* both ways, every tensor HF -> ours -> HF bit for bit
on a data 2 x fsdp 2 x tensor 2 mesh and on an interleaved pipeline, a real checkpoint exported back as
a Qwen3ForCausalLM bit for bit; imported logits equal transformers' (1e-4, fp32), and so does a greedy
continuation through our KV cache; what we cannot compute (a sliding window, layer types mixing sliding
and full attention, other RoPE types, output biases, an odd head width) is one line. Slow: through the
CLIs, greedy sampling equals `generate`, then 20 training steps export a directory transformers loads
with our logits and greedy continuation.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
safetensors_numpy = pytest.importorskip('safetensors.numpy')

from configs import tiny  # noqa: E402
from jaxfrontier import config as config_lib  # noqa: E402
from jaxfrontier import families  # noqa: E402
from jaxfrontier import mesh as mesh_lib  # noqa: E402
from jaxfrontier.checkpoint import manager as ckpt_lib  # noqa: E402
from jaxfrontier.checkpoint.interop import hf, hf_files, init_from  # noqa: E402
from jaxfrontier.errors import UserError  # noqa: E402
from jaxfrontier.inference import generate as gen  # noqa: E402
from jaxfrontier.inference import load as load_lib  # noqa: E402
from test_hf import write_corpus  # noqa: E402
from test_hf_llama import (VOCAB, ParamsReader, _edit, _save, _set, greedy_sample, hf_config_of,  # noqa: E402
                           our_logits, run_main, target_of, their_greedy, their_logits)

hf_llama = families.get('llama').hf  # the family's converter: Qwen3 is one of the architectures it reads
pytestmark = pytest.mark.filterwarnings('ignore:the load_module:DeprecationWarning')
LOGIT_ATOL = 1e-4  # fp32, as issue 36 asks


def save_qwen3(path, layers=2, heads=4, kv_heads=2, head_dim=16, tied=False, seed=3):
    """A random Qwen3ForCausalLM of width 48 whose heads are `head_dim` wide (48 / heads = 12 is not)."""
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=tied, rope_parameters={'rope_type': 'default', 'rope_theta': 1000000.0})
    return _save(transformers.Qwen3ForCausalLM, config, seed, path)


@pytest.fixture(scope='module')
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp('hf_qwen3')
    save_qwen3(root / 'qwen3')  # GQA 4 / 2, heads of 16 (q 64 wide over d 48), untied head
    save_qwen3(root / 'qwen3_4', layers=4, kv_heads=1, head_dim=8, tied=True, seed=4)  # MQA, q 32 wide, tied
    return {name: str(root / name) for name in ('qwen3', 'qwen3_4')}


# --------------------------------------------------------------------------- configs both ways


def test_qwen3_config_both_ways(dirs, tmp_path):
    c = hf_config_of(dirs['qwen3'])
    m = c.model
    assert (m.family, m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim) == (
        'llama', 2, 48, 4, 2, 16, 80)
    assert (m.qk_norm, m.qkv_bias, m.tied_embeddings, m.norm_eps, m.rope_theta, m.rope_scaling) == (
        True, False, False, 1e-6, 1e6, 'none')
    shape = config_lib.model_shape(c)
    assert shape.head_dim == 16 and shape.head_dim * shape.num_heads != shape.d_model

    written = hf_llama.hf_config(m.to_dict(), eot_id=None)  # what export writes, read back by transformers
    (tmp_path / 'config.json').write_text(json.dumps(written))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    original = transformers.AutoConfig.from_pretrained(dirs['qwen3'])
    assert type(theirs).__name__ == 'Qwen3Config' and theirs.architectures == ['Qwen3ForCausalLM']
    for key in ('vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads',
                'num_key_value_heads', 'head_dim', 'rms_norm_eps', 'tie_word_embeddings', 'hidden_act',
                'rope_parameters', 'attention_bias', 'use_sliding_window', 'sliding_window', 'layer_types'):
        assert getattr(theirs, key) == getattr(original, key), key
    assert hf.model_fields(written, 'written') == hf.model_fields(original.to_dict(), 'original')


def test_qwen3_without_head_dim_has_transformers_default():
    """Qwen3Config's head_dim is 128 where config.json has none (not hidden_size / heads, as Llama's)."""
    base = {'hidden_size': 64, 'intermediate_size': 80, 'num_hidden_layers': 1, 'num_attention_heads': 4,
            'vocab_size': 10, 'max_position_embeddings': 64}
    assert hf.model_fields(base | {'model_type': 'qwen3'}, 'q')['head_dim'] == 128
    assert hf_files.expected_shapes(base | {'model_type': 'qwen3'})['layers.0.self_attn.q_proj.weight'] == (512, 64)
    assert hf.model_fields(base | {'model_type': 'llama'}, 'l')['head_dim'] == 16


# Qwen3-4B's config.json (the published dense model whose heads, 128 wide, are not 2560 / 32 = 80).
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters={'rope_type': 'default',
                                                                              'rope_theta': 1000000.0})


def test_qwen3_4b_parameters_and_plan(tmp_path):
    """Our parameter table counts what transformers builds for Qwen3-4B (4,022,468,096: q and o 4096 wide),
    and the planner plans it on 8 MI250X GCDs (tensor 8 splits the 8 kv heads) saying the heads' width."""
    from jaxfrontier.plan import planner  # pylint: disable=import-outside-toplevel
    config = transformers.Qwen3Config(**QWEN3_4B)
    with torch.device('meta'):
        theirs = sum(p.numel() for p in transformers.Qwen3ForCausalLM(config).parameters())
    (tmp_path / 'config.json').write_text(json.dumps(config.to_dict()))
    c = config_lib.base_config()
    c.model.update(hf.model_fields(hf.read_hf_config(str(tmp_path)), str(tmp_path)), seq_len=4096)
    c.train.global_batch, c.train.micro_batch = 1, 1
    shape = config_lib.model_shape(c)  # tensor 1: the vocabulary is not padded (151,936 = 128 x 1187)
    assert sum(p.size for p in families.get('llama').param_specs(shape)) == theirs == 4_022_468_096
    c.mesh.tensor = 8
    text = planner.format_plan(planner.plan(c, 'mi250x'))
    assert 'llama: 36 layers, d 2560, 32 heads of 128 (8 k/v)' in text, text


# --------------------------------------------------------------------------- tensors both ways


def _assert_qwen3_tensors(ours, theirs, m, layers):
    d, h, g, k = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim
    for layer in range(layers):
        hf_layer = lambda n: theirs[f'model.layers.{layer}.{n}']  # noqa: E731
        np.testing.assert_array_equal(ours.layer('attn/w_q', layer),
                                      hf_layer('self_attn.q_proj.weight').T.reshape(d, h, k))
        for i, kv in enumerate('kv'):
            np.testing.assert_array_equal(ours.layer('attn/w_kv', layer)[:, i],
                                          hf_layer(f'self_attn.{kv}_proj.weight').T.reshape(d, g, k))
        np.testing.assert_array_equal(ours.layer('attn/w_out', layer),
                                      hf_layer('self_attn.o_proj.weight').T.reshape(h, k, d))
        for norm in ('q_norm', 'k_norm'):
            np.testing.assert_array_equal(ours.layer(f'attn/{norm}/scale', layer), hf_layer(f'self_attn.{norm}.weight'))


@pytest.mark.parametrize('name,arg', [('qwen3', 'data=2,fsdp=2,tensor=2'), ('qwen3_4', 'data=2,tensor=2,pipeline=2')])
def test_tensors_round_trip_exactly(dirs, name, arg):
    """HF -> ours (sharded, one layer at a time) equals the transposed HF tensors, q_norm and k_norm included;
    ours -> HF gives the file back."""
    c = hf_config_of(dirs[name], arg)
    if c.mesh.pipeline > 1:
        c.pipeline.update(schedule='interleaved', virtual_stages=2)  # blocks stored [2, 2, ...]
    params = init_from.load_params(dirs[name], c, target_of(c))
    theirs = safetensors_numpy.load_file(os.path.join(dirs[name], 'model.safetensors'))
    ours = ParamsReader(params, c.model.num_layers)
    _assert_qwen3_tensors(ours, theirs, c.model, c.model.num_layers)
    assert ours.layer('attn/q_norm/scale', 0).shape == (c.model.head_dim,)

    written = {}
    for names, read in hf._tensors(hf_llama, ours, c.model.to_dict(), hf_llama.hf_config(c.model.to_dict(), None)):
        for (tensor, shape), value in zip(names, read(), strict=True):
            assert value.shape == shape
            written[tensor] = value
    assert set(written) == set(theirs)
    for tensor, value in written.items():
        np.testing.assert_array_equal(value, theirs[tensor], err_msg=tensor)


def test_checkpoint_exports_as_the_same_qwen3(dirs, tmp_path):
    """HF -> a real checkpoint (Orbax) -> export_hf: a Qwen3ForCausalLM, bit for bit, transformers' logits."""
    c = hf_config_of(dirs['qwen3'], 'data=2,fsdp=2,tensor=2')
    c.checkpoint.async_save = False
    params = init_from.load_params(dirs['qwen3'], c, target_of(c))
    ckpt = ckpt_lib.Checkpointer(c, str(tmp_path / 'run'))
    ckpt.save(1, {'step': jnp.ones((), jnp.int32), 'params': params, 'opt_state': jnp.zeros((), jnp.float32)},
              force=True)
    ckpt.close()
    summary = hf.export_hf(str(tmp_path / 'run'), str(tmp_path / 'out'))
    assert summary['architecture'] == 'Qwen3ForCausalLM'
    exported = safetensors_numpy.load_file(str(tmp_path / 'out' / 'model.safetensors'))
    original = safetensors_numpy.load_file(os.path.join(dirs['qwen3'], 'model.safetensors'))
    assert set(exported) == set(original)
    for tensor, value in original.items():
        np.testing.assert_array_equal(exported[tensor], value, err_msg=tensor)
    tokens_bt = np.random.RandomState(5).randint(0, VOCAB, (2, 40))
    after, model = their_logits(str(tmp_path / 'out'), tokens_bt)
    assert type(model).__name__ == 'Qwen3ForCausalLM' and model.config.head_dim == 16
    np.testing.assert_array_equal(after, their_logits(dirs['qwen3'], tokens_bt)[0])


# --------------------------------------------------------------------------- our forward against transformers'


@pytest.mark.parametrize('name', ['qwen3', pytest.param('qwen3_4', marks=pytest.mark.slow)])
def test_import_gives_transformers_logits_and_greedy_continuation(dirs, tmp_path, name):
    """configs/tiny.py's mesh (data 2 x fsdp 2 x tensor 2, fp32), the model from config.json: logits within
    1e-4 of transformers', and a greedy continuation through our KV cache ([L, B, S, G, K] of K = head_dim)
    token for token what `generate` gives."""
    c = tiny.get_config()
    c.checkpoint.init_params_from = dirs[name]
    loaded = load_lib.load(c, str(tmp_path / 'no_run'))
    m = loaded.config.model
    assert (m.qk_norm, m.head_dim) == (True, {'qwen3': 16, 'qwen3_4': 8}[name])
    tokens_bt = np.random.RandomState(3).randint(0, VOCAB, (4, 48))
    theirs, model = their_logits(dirs[name], tokens_bt)
    ours = our_logits(loaded, tokens_bt)
    np.testing.assert_allclose(ours, theirs, atol=LOGIT_ATOL, rtol=0)
    print(f'{name}: max |logit difference| {np.abs(ours - theirs).max():.2e}')

    prompt_bp = tokens_bt[:, :12]
    with torch.no_grad():
        want = model.generate(torch.tensor(prompt_bp), max_new_tokens=10, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[:, 12:].numpy()
    run = gen.make_generate(loaded.layout.model_def, max_new=10, rule=gen.Sampling(temperature=0.0))
    with jax.set_mesh(loaded.layout.mesh), mesh_lib.use_rules(loaded.layout.rules):
        got = run(loaded.params, jnp.asarray(prompt_bp), jnp.full((4,), 12, jnp.int32), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(got), want)


# --------------------------------------------------------------------------- what we cannot compute: one line each


def _types(*kinds):
    return lambda config: config.update(layer_types=list(kinds))


MISMATCHES = {  # what is changed -> what the one line says
    'sliding_window': (_set(use_sliding_window=True, sliding_window=16, max_window_layers=0,
                            layer_types=['sliding_attention'] * 2), 'sliding_window = 16'),
    'mixed_layer_types': (_set(use_sliding_window=True, sliding_window=16, max_window_layers=1,
                               layer_types=['full_attention', 'sliding_attention']),
                          'layer_types = \'1 sliding_attention and 1 full_attention layers\''),
    'unknown_layer_type': (_types('full_attention', 'chunked_attention'), "layer_types[1] = 'chunked_attention'"),
    'rope_type': (lambda c: c['rope_parameters'].update(rope_type='yarn', factor=4.0), "rope_type = 'yarn'"),
    'attention_bias': (_set(attention_bias=True), 'attention_bias = True'),  # Qwen3's: on the output projection too
    'hidden_act': (_set(hidden_act='gelu'), "hidden_act = 'gelu'"),
}
BIASES = {f'model.layers.{i}.self_attn.{p}_proj.bias': np.zeros(n, np.float32)
          for i in range(2) for p, n in (('q', 64), ('k', 32), ('v', 32), ('o', 48))}


@pytest.mark.parametrize('what', sorted(MISMATCHES))
def test_what_we_cannot_compute_is_one_line(dirs, tmp_path, what):
    config, said = MISMATCHES[what]
    source = _edit(dirs['qwen3'], tmp_path / 'hf', config, (lambda t: t.update(BIASES)) if what == 'attention_bias'
                   else None)
    with pytest.raises(UserError) as e:
        hf.model_fields(hf_files.check(source)[0], source)  # as configs/hf.py and inference/load.py read it
    assert said in str(e.value) and '\n' not in str(e.value), str(e.value)


def test_odd_head_dim_is_one_line(dirs, tmp_path):
    """A consistent directory (tensors of head_dim 15) that RoPE cannot rotate (it turns pairs)."""
    source = _edit(dirs['qwen3'], tmp_path / 'hf', _set(head_dim=15), lambda t: t.update({
        f'model.layers.{i}.self_attn.{p}': np.zeros(s, np.float32) for i in range(2) for p, s in (
            ('q_proj.weight', (60, 48)), ('k_proj.weight', (30, 48)), ('v_proj.weight', (30, 48)),
            ('o_proj.weight', (48, 60)), ('q_norm.weight', (15,)), ('k_norm.weight', (15,)))}))
    with pytest.raises(UserError, match=r'head_dim = 15, which jaxfrontier cannot compute.*even'):
        hf.model_fields(hf_files.check(source)[0], source)


@pytest.mark.parametrize('change,said', [
    (lambda t: t.pop('model.layers.1.self_attn.k_norm.weight'), "no tensor 'layers.1.self_attn.k_norm.weight'"),
    (lambda t: t.update({'model.layers.0.self_attn.q_norm.weight': np.ones(12, np.float32)}),
     "'layers.0.self_attn.q_norm.weight' has shape [12], its config.json needs [16]")])
def test_damaged_norm_tensors_are_one_line(dirs, tmp_path, change, said):
    source = _edit(dirs['qwen3'], tmp_path / 'hf', tensors=change)
    with pytest.raises(UserError) as e:
        hf_files.check(source)
    assert said in str(e.value) and '\n' not in str(e.value), str(e.value)


@pytest.mark.parametrize('fields,said', [
    (dict(head_dim=16), 'only Qwen3 (qk_norm) has a head width of its own'),
    (dict(qk_norm=True, qkv_bias=True), 'qk_norm with qkv_bias'),
])
def test_export_refuses_what_no_architecture_has(fields, said):
    """Llama and Qwen2 have heads of hidden_size / heads; Qwen3 biases all four projections or none."""
    m = config_lib.base_config().model.to_dict() | dict(family='llama', d_model=48, num_heads=4) | fields
    with pytest.raises(UserError) as e:
        hf_llama.check_exportable(m, 'run/checkpoints/1')
    assert said in str(e.value) and 'Fix:' in str(e.value) and '\n' not in str(e.value)


@pytest.mark.parametrize('field,value,fix', [('head_dim', 0, '--config.model.head_dim=16'),
                                             ('qk_norm', False, '--config.model.qk_norm=True')])
def test_config_that_differs_from_the_directory_is_one_line(dirs, field, value, fix):
    c = hf_config_of(dirs['qwen3'], 'data=2,fsdp=2,tensor=2')
    c.model[field] = value
    with pytest.raises(UserError) as e:
        hf.check_matches(hf.model_fields(hf.read_hf_config(dirs['qwen3']), dirs['qwen3']), c, dirs['qwen3'], False)
    assert f'config.model.{field} = {value!r}' in str(e.value) and fix in str(e.value), str(e.value)


# --------------------------------------------------------------------------- through the command line


@pytest.mark.slow
def test_continue_training_then_export_through_the_clis(dirs, tmp_path):
    """configs/hf.py:path=<Qwen3 dir> samples as transformers does, trains 20 steps on our tokens, exports a
    Qwen3ForCausalLM transformers loads with our logits and our greedy continuation."""
    corpus, vocab = write_corpus(tmp_path)
    assert vocab <= VOCAB
    source = tmp_path / 'source'
    shutil.copytree(dirs['qwen3'], source)
    shutil.copyfile(tmp_path / 'corpus.tokenizer.json', source / 'tokenizer.json')
    workdir, out = tmp_path / 'run', tmp_path / 'exported'
    common = (f'--config=configs/hf.py:path={source},seq_len=32,data=2,fsdp=2,tensor=2', '--config.mesh.cpu_devices=8',
              '--config.model.dtype=float32', f'--config.data.path={corpus}', '--config.train.progress=False',
              '--config.train.eval_every=0', '--config.train.log_every=5', f'--workdir={workdir}')
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(source / 'tokenizer.json'))
    prompt = 'the cat sat'
    _, original = their_logits(source, np.zeros((1, 1), np.int64))
    assert greedy_sample(*common, prompt=prompt) == their_greedy(original, tokenizer, prompt)

    run_main(*common, '--config.train.steps=20', '--config.optim.lr=1e-3', '--config.optim.warmup_steps=2')
    run_main(*common, '--mode=export', '--export_format=hf', f'--export_path={out}')
    tokens_bt = np.random.RandomState(4).randint(0, vocab, (4, 32))
    theirs, model = their_logits(out, tokens_bt)
    assert type(model).__name__ == 'Qwen3ForCausalLM' and model.config.head_dim == 16
    loaded = load_lib.load(tiny.get_config(), str(workdir))
    ours = our_logits(loaded, tokens_bt)
    np.testing.assert_allclose(ours, theirs, atol=LOGIT_ATOL, rtol=0)
    assert np.abs(ours - their_logits(source, tokens_bt)[0]).max() > 1e-2  # 20 steps changed the model
    assert greedy_sample(*common, prompt=prompt) == their_greedy(model, tokenizer, prompt)
