"""Hugging Face Mixtral and Qwen3-MoE interop (families/hf_moe.py through the driver checkpoint/interop/hf.py).

`transformers` (CPU, fp32) builds tiny random models and saves them: a Mixtral (GQA 4 / 2, 4 experts of
width 32, top 2, untied head) and a Qwen3-MoE (QK-norm, heads of 16 over a width of 48, 4 experts of 24
while the dense width is 80, top 2 without renormalisation: norm_topk_prob false), routers randomized
wide apart so no top-k choice is a near tie. A copy of the Qwen3-MoE holds transformers 5's fused
in-memory layout (`experts.gate_up_proj`, `experts.down_proj`: its state dict saved as it is). Checked:
config.json <-> model.* both ways (what we write transformers reads as the same model), the fused layout
reads as the per-expert one, every mismatch one line (exit 2 through the CLI); our forward: imported
logits equal transformers' within 1e-4 (fp32) on data 2 x fsdp 2 x tensor 2 and a greedy continuation
through our KV cache equals `generate`; a real checkpoint exports as the same model, bit for bit, which
transformers loads with the same logits.
"""

import json
import os
import shutil
import subprocess
import sys

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
from test_hf_llama import (VOCAB, ParamsReader, _edit, _randomize, _set, hf_config_of, our_logits,  # noqa: E402
                           target_of)
import processes  # noqa: E402

converter = families.get('llama').hf  # the Llama family's converter reads Mixtral and Qwen3-MoE too
pytestmark = pytest.mark.filterwarnings('ignore:the load_module:DeprecationWarning')
LOGIT_ATOL = 1e-4  # fp32, as issue 36 asks
ROUTER_STD = 2.0  # the routers' weights: top-k choices far from ties


def _save(model_class, config, seed, path):
    torch.manual_seed(seed)
    model = model_class(config).eval()
    _randomize(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith('gate.weight'):  # the router (Qwen3-MoE's initialises at zero)
                p.copy_(torch.randn_like(p) * ROUTER_STD)
    model.save_pretrained(path)
    return model


def save_mixtral(path):
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=False, router_aux_loss_coef=0.02,
        rope_parameters={'rope_type': 'default', 'rope_theta': 1000000.0})
    return _save(transformers.MixtralForCausalLM, config, 5, path)


def save_qwen3_moe(path):
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={'rope_type': 'default', 'rope_theta': 1000000.0})
    return _save(transformers.Qwen3MoeForCausalLM, config, 6, path)


@pytest.fixture(scope='module')
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp('hf_moe')
    save_mixtral(root / 'mixtral')
    model = save_qwen3_moe(root / 'qwen3_moe')
    fused = root / 'qwen3_moe_fused'  # transformers 5's in-memory names: experts fused
    shutil.copytree(root / 'qwen3_moe', fused)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    assert 'model.layers.0.mlp.experts.gate_up_proj' in state
    safetensors_numpy.save_file(state, str(fused / 'model.safetensors'), metadata={'format': 'pt'})
    return {name: str(root / name) for name in ('mixtral', 'qwen3_moe', 'qwen3_moe_fused')}


def their_logits(path, tokens_bt):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens_bt)).logits.numpy(), model


# --------------------------------------------------------------------------- configs and tensors, no JAX


@pytest.mark.parametrize('name,arch,fields', [
    ('mixtral', 'MixtralForCausalLM', dict(moe_experts=4, moe_top_k=2, moe_mlp_dim=32, moe_norm_topk=True,
                                           qk_norm=False, moe_lb_coef=0.02)),
    ('qwen3_moe', 'Qwen3MoeForCausalLM', dict(moe_experts=4, moe_top_k=2, moe_mlp_dim=24, mlp_dim=80, head_dim=16,
                                              moe_norm_topk=False, qk_norm=True, moe_lb_coef=0.001))])
def test_config_both_ways(dirs, tmp_path, name, arch, fields):
    m = hf_config_of(dirs[name]).model
    assert {k: m[k] for k in fields} == fields
    assert (m.family, m.moe_router, m.moe_shared_experts, m.moe_first_dense, m.moe_router_bias) == (
        'llama', 'softmax', 0, 0, False)
    written = converter.hf_config(m.to_dict(), eot_id=None)  # what export writes, read back by transformers
    (tmp_path / 'config.json').write_text(json.dumps(written))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    original = transformers.AutoConfig.from_pretrained(dirs[name])
    assert theirs.architectures == [arch] and type(theirs) is type(original)
    for key in ('hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads', 'num_key_value_heads',
                'head_dim', 'num_local_experts', 'num_experts_per_tok', 'moe_intermediate_size', 'norm_topk_prob',
                'router_aux_loss_coef', 'rms_norm_eps', 'rope_parameters', 'sliding_window', 'mlp_only_layers',
                'decoder_sparse_step', 'tie_word_embeddings'):
        assert _value(theirs, key) == _value(original, key), key
    assert hf.model_fields(written, 'written') == hf.model_fields(original.to_dict(), 'original')


def _value(config, key):
    """A transformers config's value of `key` (a head width of None: hidden_size / heads)."""
    value = getattr(config, key, None)
    return config.hidden_size // config.num_attention_heads if key == 'head_dim' and value is None else value


def test_fused_layout_reads_as_the_per_expert_one(dirs):
    """transformers 5's fused experts (gate_up [E, 2F, d], down [E, d, F]) give our tensors bit for bit."""
    hub, fused = (hf_files.check(dirs[n]) for n in ('qwen3_moe', 'qwen3_moe_fused'))
    config = hub[0]
    layouts = converter.layer_layouts(config)
    assert hf_files.layout_of(converter, config, {n.removeprefix('model.') for n in fused[1]}) == layouts[1]
    for ours, shape in (('mlp/w_router', (48, 4)), ('mlp/w_gate', (4, 48, 24)), ('mlp/w_up', (4, 48, 24)),
                        ('mlp/w_down', (4, 24, 48))):
        got = [converter.from_hf(ours, [hf_files.read_tensor(files[f'model.layers.1.{theirs}'])
                                        for o, theirs, _ in layout if o == ours], shape)
               for (_, files), layout in ((hub, layouts[0]), (fused, layouts[1]))]
        np.testing.assert_array_equal(got[0], got[1], err_msg=ours)
        assert [x.shape for x in converter.to_hf(ours, got[0])] == [s for o, _, s in layouts[0] if o == ours]


@pytest.mark.slow
@pytest.mark.parametrize('name,arg,expert', [('mixtral', 'data=2,tensor=2', 2),
                                             ('qwen3_moe_fused', 'data=2,tensor=2,pipeline=2', 1)])
def test_tensors_round_trip_exactly(dirs, name, arg, expert):
    """HF -> ours (sharded one layer at a time: the experts over `expert`, or the layers over `pipeline`)
    equals the HF experts transposed by hand; ours -> HF, through the exporter's own
    tensor list, gives the hub's per-expert tensors back bit for bit."""
    c = hf_config_of(dirs[name], arg)
    c.mesh.expert = expert
    params = init_from.load_params(dirs[name], c, target_of(c))
    hub = dirs[name].removesuffix('_fused')
    theirs = safetensors_numpy.load_file(os.path.join(hub, 'model.safetensors'))
    ours = ParamsReader(params, c.model.num_layers)
    prefix, (gate, up, down) = {'mixtral': ('block_sparse_moe.', ('w1', 'w3', 'w2')),
                                'qwen3_moe': ('mlp.', ('gate_proj', 'up_proj', 'down_proj'))}[os.path.basename(hub)]
    for layer in range(c.model.num_layers):
        hf_layer = lambda n: theirs[f'model.layers.{layer}.{prefix}{n}.weight']  # noqa: E731
        np.testing.assert_array_equal(ours.layer('mlp/w_router', layer), hf_layer('gate').T)
        for i in range(4):
            for ours_name, theirs_name in (('mlp/w_gate', gate), ('mlp/w_up', up), ('mlp/w_down', down)):
                np.testing.assert_array_equal(ours.layer(ours_name, layer)[i], hf_layer(f'experts.{i}.{theirs_name}').T)
    m = c.model.to_dict()
    written = {}
    for names, read in hf._tensors(converter, ours, m, converter.hf_config(m, None)):
        for (tensor, shape), value in zip(names, read(), strict=True):
            assert value.shape == shape
            written[tensor] = value
    assert set(written) == set(theirs)
    for tensor, value in written.items():
        np.testing.assert_array_equal(value, theirs[tensor], err_msg=tensor)


# --------------------------------------------------------------------------- what we cannot compute: one line each


MISMATCHES = {  # directory, what is changed -> what the one line says
    'mlp_only_layers': ('qwen3_moe', _set(mlp_only_layers=[0]), None, 'mlp_only_layers = [0]'),
    'sparse_step': ('qwen3_moe', _set(decoder_sparse_step=2), None, 'decoder_sparse_step = 2'),
    'jitter': ('mixtral', _set(router_jitter_noise=0.1), None, 'router_jitter_noise = 0.1'),
    'expert_counts': ('mixtral', _set(num_experts=8), None, 'num_experts = 8'),
    'top_k': ('mixtral', _set(num_experts_per_tok=5), None, 'num_experts_per_tok = 5'),
    'sliding_window': ('mixtral', _set(sliding_window=16), None, 'sliding_window = 16'),
    'missing_expert': ('mixtral', None, lambda t: t.pop('model.layers.1.block_sparse_moe.experts.3.w2.weight'),
                       "no tensor 'layers.1.block_sparse_moe.experts.3.w2.weight'"),
    'fewer_experts': ('qwen3_moe_fused', _set(num_local_experts=3), None,
                      "'layers.0.mlp.gate.weight' has shape [4, 48], its config.json needs [3, 48]"),
}


@pytest.mark.parametrize('what', sorted(MISMATCHES))
def test_what_we_cannot_read_is_one_line(dirs, tmp_path, what):
    name, config, tensors, said = MISMATCHES[what]
    source = _edit(dirs[name], tmp_path / 'hf', config, tensors)
    with pytest.raises(UserError) as e:
        hf.model_fields(hf_files.check(source)[0], source)  # as configs/hf.py and inference/load.py read it
    assert said in str(e.value) and '\n' not in str(e.value), str(e.value)


@pytest.mark.parametrize('field,value,fix', [('moe_experts', 8, '--config.model.moe_experts=4'),
                                             ('moe_top_k', 1, '--config.model.moe_top_k=2'),
                                             ('moe_norm_topk', True, '--config.model.moe_norm_topk=False')])
def test_config_that_differs_from_the_directory_is_one_line(dirs, field, value, fix):
    """The run's config against the directory's (an expert count that is not the checkpoint's, ...); the
    balancing coefficient is a starting value a run may change."""
    c = hf_config_of(dirs['qwen3_moe'])
    fields = {k: v for k, v in hf.model_fields(hf.read_hf_config(dirs['qwen3_moe']), 'd').items()
              if k not in converter.unmatched}
    assert 'moe_lb_coef' not in fields
    c.model[field] = value
    with pytest.raises(UserError) as e:
        hf.check_matches(fields, c, dirs['qwen3_moe'], False)
    assert f'config.model.{field} = {value!r}' in str(e.value) and fix in str(e.value), str(e.value)


@pytest.mark.parametrize('fields,said', [
    (dict(moe_shared_experts=1), '1 shared experts'), (dict(moe_first_dense=1), 'the first 1 layers dense'),
    (dict(moe_router='sigmoid'), 'a router other than a softmax'), (dict(moe_norm_topk=False), 'always renormalises'),
])
def test_export_refuses_what_neither_architecture_has(fields, said):
    m = config_lib.base_config().model.to_dict() | dict(family='llama', d_model=48, num_heads=4, moe_experts=4) | fields
    with pytest.raises(UserError) as e:
        converter.check_exportable(m, 'run/checkpoints/1')
    assert said in str(e.value) and 'Fix:' in str(e.value) and '\n' not in str(e.value), str(e.value)


@pytest.mark.slow
def test_cli_refusal_is_one_line_exit_2(dirs, tmp_path):
    source = _edit(dirs['qwen3_moe'], tmp_path / 'hf', MISMATCHES['mlp_only_layers'][1])
    proc = subprocess.run([sys.executable, '-m', 'jaxfrontier.main', f'--config=configs/hf.py:path={source}',
                           f'--workdir={tmp_path / "run"}'], cwd=processes.REPO, env=processes.subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    line = processes.error_line(proc)
    assert 'mlp_only_layers = [0]' in line and 'Fix:' in line


# --------------------------------------------------------------------------- our forward against transformers'


@pytest.mark.slow
@pytest.mark.parametrize('name', ['qwen3_moe_fused', 'mixtral'])
def test_import_gives_transformers_logits_and_greedy_continuation(dirs, tmp_path, name):
    """configs/tiny.py's mesh (data 2 x fsdp 2 x tensor 2, fp32), the model from config.json: logits within
    1e-4 of transformers', and a greedy continuation through our KV cache what `generate` gives."""
    c = tiny.get_config()
    c.checkpoint.init_params_from = dirs[name]
    loaded = load_lib.load(c, str(tmp_path / 'no_run'))
    assert loaded.config.model.moe_experts == 4
    tokens_bt = np.random.RandomState(3).randint(0, VOCAB, (4, 32))
    theirs, model = their_logits(dirs[name], tokens_bt)
    ours = our_logits(loaded, tokens_bt)
    np.testing.assert_allclose(ours, theirs, atol=LOGIT_ATOL, rtol=0)
    print(f'{name}: max |logit difference| {np.abs(ours - theirs).max():.2e}')

    prompt_bp = tokens_bt[:, :12]
    with torch.no_grad():
        want = model.generate(torch.tensor(prompt_bp), max_new_tokens=6, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[:, 12:].numpy()
    run = gen.make_generate(loaded.layout.model_def, max_new=6, rule=gen.Sampling(temperature=0.0))
    with jax.set_mesh(loaded.layout.mesh), mesh_lib.use_rules(loaded.layout.rules):
        got = run(loaded.params, jnp.asarray(prompt_bp), jnp.full((4,), 12, jnp.int32), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.slow
@pytest.mark.parametrize('name,arch', [('mixtral', 'MixtralForCausalLM'), ('qwen3_moe_fused', 'Qwen3MoeForCausalLM')])
def test_checkpoint_exports_as_the_same_model(dirs, tmp_path, name, arch):
    """HF -> a real checkpoint (Orbax) -> export_hf: the hub's per-expert tensors bit for bit (from the fused
    layout too), a config transformers reads, its logits the original's."""
    c = hf_config_of(dirs[name], 'data=2,fsdp=2,tensor=2')
    c.checkpoint.async_save = False
    params = init_from.load_params(dirs[name], c, target_of(c))
    ckpt = ckpt_lib.Checkpointer(c, str(tmp_path / 'run'))
    ckpt.save(1, {'step': jnp.ones((), jnp.int32), 'params': params, 'opt_state': jnp.zeros((), jnp.float32)},
              force=True)
    ckpt.close()
    summary = hf.export_hf(str(tmp_path / 'run'), str(tmp_path / 'out'))
    assert summary['architecture'] == arch
    exported = safetensors_numpy.load_file(str(tmp_path / 'out' / 'model.safetensors'))
    hub = dirs[name].removesuffix('_fused')
    original = safetensors_numpy.load_file(os.path.join(hub, 'model.safetensors'))
    assert set(exported) == set(original)
    for tensor, value in original.items():
        np.testing.assert_array_equal(exported[tensor], value, err_msg=tensor)
    tokens_bt = np.random.RandomState(5).randint(0, VOCAB, (2, 24))
    after, model = their_logits(str(tmp_path / 'out'), tokens_bt)
    assert type(model).__name__ == arch
    np.testing.assert_array_equal(after, their_logits(hub, tokens_bt)[0])
