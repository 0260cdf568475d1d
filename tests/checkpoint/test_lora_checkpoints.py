"""A LoRA run end to end: trained over a Hugging Face base, checkpointed alone, resumed, exported.

`transformers` (CPU, fp32) saves a tiny random Llama (GQA 4/2 heads, an untied head, Llama 3.1 RoPE); a LoRA
run (rank 4 on q, v, o and down: v is one slice of the fused w_kv, o contracts two dimensions) trains over it
on data 2 x fsdp 2 x tensor 2 with `train_and_evaluate`. Checked: the checkpoint holds the adapters and their
optimizer state alone and records its base; a resume continues bit for bit; another base is refused with
one line (nothing lost); the PEFT export loads with `peft.PeftModel.from_pretrained` onto the transformers
base with our logits (1e-4, fp32), the merged Hugging Face export loads with `transformers` with them too,
the merged safetensors export starts a run without LoRA that computes them, and the exports refuse what
they cannot write.
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
peft = pytest.importorskip('peft')

from jaxfrontier import config as config_lib  # noqa: E402
from jaxfrontier import mesh as mesh_lib  # noqa: E402
from jaxfrontier.checkpoint import readers  # noqa: E402
from jaxfrontier.checkpoint.interop import hf  # noqa: E402
from jaxfrontier.checkpoint.interop import init_from  # noqa: E402
from jaxfrontier.checkpoint.interop import peft as peft_export  # noqa: E402
from jaxfrontier.checkpoint.interop import safetensors as safetensors_lib  # noqa: E402
from jaxfrontier.checkpoint import target as target_lib  # noqa: E402
from jaxfrontier.errors import CheckpointError, ConfigError  # noqa: E402
from jaxfrontier.families import lora as lora_np  # noqa: E402
from jaxfrontier.inference import load as load_lib  # noqa: E402
from jaxfrontier.run import loop  # noqa: E402
from test_hf_llama import hf_config_of, save_llama  # noqa: E402

# slow: the module's training run (~20 s) feeds every test here
pytestmark = [pytest.mark.filterwarnings('ignore:the load_module:DeprecationWarning'), pytest.mark.slow]
TARGETS = 'q,v,o,down'


def lora_config(base: str, steps: int = 6, **lora):
    c = hf_config_of(base, 'data=2,fsdp=2,tensor=2,micro_batch=2,seq_len=16')
    c.model.update(dtype='float32', remat='none', attention='reference')
    c.lora.update(**{'rank': 4, 'alpha': 8.0, 'targets': TARGETS, **lora})
    c.data.kind = 'synthetic'
    c.train.update(steps=steps, log_every=1, eval_every=0, eval_batches=1, progress=False)
    c.optim.update(lr=1e-2, warmup_steps=0, schedule='constant')  # a schedule that does not depend on train.steps
    c.checkpoint.update(every_steps=3, async_save=False)
    config_lib.validate(c)
    return c


@pytest.fixture(scope='module')
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp('lora')
    base = str(root / 'base')
    save_llama(base, layers=2)
    workdir = str(root / 'run')
    loop.train_and_evaluate(lora_config(base), workdir)
    return {'root': root, 'base': base, 'workdir': workdir}


def tokens_of(batch=4, length=11):
    return np.random.default_rng(5).integers(0, 300, (batch, length)).astype(np.int32)


def our_logits(c, workdir: str, tokens_bt: np.ndarray) -> np.ndarray:
    """Logits of a run's newest checkpoint (for LoRA: its base with its adapters, unmerged), real vocabulary."""
    loaded = load_lib.load(c, workdir)
    with jax.set_mesh(loaded.layout.mesh), mesh_lib.use_rules(loaded.layout.rules):
        logits = jax.jit(lambda p, t: loaded.layout.model_def.bind(p)(t))(loaded.params, jnp.asarray(tokens_bt))
    return np.asarray(logits)[..., :loaded.config.model.vocab_size]


def test_the_checkpoint_holds_the_adapters_alone_and_records_its_base(run):
    step_dir = readers.step_dir_of(run['workdir'])
    tree = readers.flatten_names(readers.saved_tree(step_dir))
    params = [n.removeprefix('params/') for n in tree if n.startswith('params/')]
    assert params and all(lora_np.is_adapter(n) for n in params), params
    assert not any(n.startswith('frozen') for n in tree)
    moments = [n for n in tree if n.startswith('opt_state/') and tree[n].shape]
    assert moments and all(lora_np.is_adapter(n) for n in moments if '/blocks/' in n), moments
    meta = readers.read_meta(step_dir)
    assert meta['lora_base']['path'] == os.path.abspath(run['base']) and len(meta['lora_base']['fingerprint']) == 64
    adapters = sum(int(np.prod(tree['params/' + n].shape)) for n in params)
    base = sum(v.numel() for v in transformers.LlamaForCausalLM.from_pretrained(run['base']).parameters())
    assert adapters < base / 10, (adapters, base)
    assert readers.read_meta(step_dir)['step'] == 6


def test_resume_continues_bit_for_bit(run, tmp_path):
    """3 steps, then a resume to 6, gives the adapters and moments of 6 steps straight (the base read again)."""
    workdir = str(tmp_path / 'resumed')
    loop.train_and_evaluate(lora_config(run['base'], steps=3), workdir)
    loop.train_and_evaluate(lora_config(run['base'], steps=6), workdir)
    straight, resumed = (readers.flatten_names(readers.restore_params(
        readers.step_dir_of(w), *_restore_args(w))) for w in (run['workdir'], workdir))
    assert straight.keys() == resumed.keys()
    for name in straight:
        np.testing.assert_array_equal(resumed[name], straight[name], err_msg=name)


def _restore_args(workdir):
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
    tree = readers.saved_tree(readers.step_dir_of(workdir))['params']
    item = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), np.dtype(m.dtype)), tree)
    return item, jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)


def test_another_base_is_refused_with_one_line_and_nothing_lost(run, tmp_path):
    other = str(tmp_path / 'other')
    shutil.copytree(run['base'], other)
    path = os.path.join(other, 'model.safetensors')
    from safetensors.numpy import load_file, save_file  # pylint: disable=import-outside-toplevel
    tensors = load_file(path)
    tensors['model.norm.weight'] = tensors['model.norm.weight'] + 1.0  # same shapes, another model
    save_file(tensors, path, metadata={'format': 'pt'})
    steps = sorted(os.listdir(os.path.join(run['workdir'], 'checkpoints')))
    c = lora_config(run['base'], steps=9)
    c.checkpoint.init_params_from = other
    with pytest.raises(ConfigError) as e:
        loop.train_and_evaluate(c, run['workdir'])
    assert 'is not the base model the LoRA adapters of' in str(e.value) and '\n' not in str(e.value)
    assert f'init_params_from={os.path.abspath(run["base"])}' in str(e.value)
    assert sorted(os.listdir(os.path.join(run['workdir'], 'checkpoints'))) == steps
    with pytest.raises(ConfigError, match='is not the base model'):  # the merged export checks it too
        hf.export_hf(_with_base(run, tmp_path, other), str(tmp_path / 'hf'))


def _with_base(run, tmp_path, base: str) -> str:
    """A copy of the run's newest step whose saved config names `base` as init_params_from."""
    step_dir = readers.step_dir_of(run['workdir'])
    copy = str(tmp_path / 'copy' / 'checkpoints' / os.path.basename(step_dir))
    shutil.copytree(step_dir, copy)
    meta_path = os.path.join(copy, 'meta', 'metadata')
    meta = json.load(open(meta_path))
    meta['config']['checkpoint']['init_params_from'] = base
    json.dump(meta, open(meta_path, 'w'))
    return copy


def test_peft_export_loads_onto_the_transformers_base_with_our_logits(run, tmp_path):
    out = str(tmp_path / 'peft')
    summary = peft_export.export_peft(run['workdir'], out)
    adapter = json.load(open(os.path.join(out, 'adapter_config.json')))
    assert {k: adapter[k] for k in ('peft_type', 'task_type', 'r', 'lora_alpha', 'lora_dropout', 'bias',
                                    'fan_in_fan_out', 'base_model_name_or_path')} == {
        'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'r': 4, 'lora_alpha': 8.0, 'lora_dropout': 0.0,
        'bias': 'none', 'fan_in_fan_out': False, 'base_model_name_or_path': os.path.abspath(run['base'])}
    assert adapter['target_modules'] == ['down_proj', 'o_proj', 'q_proj', 'v_proj'] == summary['target_modules']
    from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
    tensors = load_file(os.path.join(out, 'adapter_model.safetensors'))
    assert tensors['base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight'].shape == (4, 48)
    assert tensors['base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight'].shape == (24, 4)  # 2 kv x 12
    assert tensors['base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight'].shape == (4, 48)
    assert len(tensors) == 2 * 2 * 4 and summary['tensors'] == 16
    base = transformers.LlamaForCausalLM.from_pretrained(run['base']).eval()
    model = peft.PeftModel.from_pretrained(base, out).eval()
    tokens = tokens_of()
    with torch.no_grad():
        theirs = model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
        plain = transformers.LlamaForCausalLM.from_pretrained(run['base']).eval()(
            torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    ours = our_logits(lora_config(run['base']), run['workdir'], tokens)
    assert np.max(np.abs(ours - plain)) > 1e-2  # the adapters were trained: they change the logits
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    print(f'PEFT vs ours: max |logit difference| {np.max(np.abs(ours - theirs)):.2e}')


def test_merged_hf_export_loads_in_transformers_with_our_logits(run, tmp_path):
    out = str(tmp_path / 'hf')
    summary = hf.export_hf(run['workdir'], out)
    assert summary['architecture'] == 'LlamaForCausalLM'
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = tokens_of()
    with torch.no_grad():
        theirs = model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(our_logits(lora_config(run['base']), run['workdir'], tokens), theirs, atol=1e-4, rtol=0)


def test_merged_safetensors_export_starts_a_model_without_lora(run, tmp_path):
    out = str(tmp_path / 'merged.safetensors')
    names = safetensors_lib.export_params(run['workdir'], out)
    assert not any(lora_np.is_adapter(n) for n in names)
    c = lora_config(run['base'], rank=0, targets=lora_np.FIELDS['targets'])  # no LoRA: the default targets
    c.checkpoint.init_params_from = out
    placement = target_lib.param_placement(c, mesh_lib.mesh_from_config(c))
    params = init_from.load_params(out, c, placement.target())
    tokens = tokens_of()
    with jax.set_mesh(placement.mesh), mesh_lib.use_rules(placement.rules):
        logits = jax.jit(lambda p, t: placement.model_def.bind(p)(t))(params, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(logits)[..., :300], our_logits(lora_config(run['base']), run['workdir'],
                                                                          tokens), atol=1e-4, rtol=0)


def test_exports_refuse_what_they_cannot_write(run, tmp_path):
    """PEFT export of a run without LoRA, and of a family whose targets are not torch Linears: one line each."""
    with pytest.raises(CheckpointError, match='holds no LoRA adapters') as e:
        peft_export.export_peft(_with_lora(run, tmp_path, {'rank': 0}), str(tmp_path / 'p1'))
    assert '\n' not in str(e.value)
    missing = peft_export._check  # pylint: disable=protected-access
    gpt = config_lib.model_shape(_gpt_lora()).lora
    with pytest.raises(CheckpointError, match=r"the gpt family's LoRA targets \['q', 'v'\] have no PEFT module"):
        missing(gpt, 'gpt', 'somewhere')


def _with_lora(run, tmp_path, lora: dict) -> str:
    step_dir = _with_base(run, tmp_path, run['base'])
    meta_path = os.path.join(step_dir, 'meta', 'metadata')
    meta = json.load(open(meta_path))
    meta['config']['lora'].update(lora)
    json.dump(meta, open(meta_path, 'w'))
    return step_dir


def _gpt_lora():
    c = config_lib.base_config()
    c.lora.update(rank=2, targets='q,v')
    config_lib.validate(c)
    return c
