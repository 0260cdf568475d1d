"""`--mode=verify`: the shrunk layout against one device (jaxfrontier/plan/shrink.py, verify.py, fanout.py).

The shrink is checked without devices on the paper's configs; the certificate runs in this
process on the 8 simulated devices (slow tier), passing for right layouts (an interleaved
pipeline with data and tensor; a Llama on tensor x fsdp) and failing, with the quantity named,
when the test breaks the data-parallel reduction. A ZeRO-1 layout's certificate, through
`python -m jaxfrontier.main --mode=verify` itself, is tests/sweep/test_sweep.py's verifier test.
The multi-process path (more devices than one XLA:CPU process runs: plan/fanout.py) runs through
the CLI with the per-process limit lowered to 4, so the 8 devices are 2 processes joined by
jax.distributed.
"""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import pytest

from jaxfrontier import config as config_lib
from jaxfrontier.errors import ConfigError
from jaxfrontier.plan import fanout
from jaxfrontier.plan import shrink as shrink_lib
from jaxfrontier.plan import verify
from jaxfrontier.training import reduction

import processes

sys.path.insert(0, os.path.join(processes.REPO, 'configs'))  # paper.py, which the paper configs import


def _paper(name):
    """configs/<name>.py's config (22b.py is not an importable module name)."""
    spec = importlib.util.spec_from_file_location(f'config_{name}', os.path.join(processes.REPO, 'configs', f'{name}.py'))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


@pytest.mark.parametrize('name, devices, data, layers, accum', [
    ('22b', 32, 1, 8, 16),  # TP 4 x PP 8: nothing but the size shrinks
    ('175b', 128, 2, 16, 32),
    ('1t', 1536, 3, 64, 128),  # TP 8 x PP 64 x DP 6 = 3,072 devices: data 6 -> 3 to fit 2,048 (6 processes)
])
def test_shrink_keeps_the_layout_of_the_paper_configs(name, devices, data, layers, accum):
    c = _paper(name)
    s = shrink_lib.shrink(c)
    assert s.num_devices == devices and s.config.mesh.data == data
    assert (s.config.model.num_layers, s.config.train.accum_steps) == (layers, accum)
    for field in ('mesh.tensor', 'mesh.pipeline', 'pipeline.schedule', 'sharding.zero1', 'model.remat',
                  'model.dtype', 'model.attention', 'model.tied_embeddings'):
        section, key = field.split('.')
        assert s.config[section][key] == c[section][key], field
        assert field in s.kept
    assert ('mesh.data' in s.shrunk) == (c.mesh.data != data)
    assert s.shrunk['model.num_layers'] == (c.model.num_layers, layers)
    assert s.config.model.num_heads % c.mesh.tensor == 0
    config_lib.validate(shrink_lib.reference_config(s.config), 1)
    assert 'data 6 -> 3' in shrink_lib.describe(s) if name == '1t' else 'data' not in shrink_lib.describe(s)


@pytest.mark.parametrize('tensor,kv,split', [(4, 8, True), (4, 2, False), (8, 2, False), (2, 8, True)])
def test_shrink_keeps_whether_tensor_splits_the_llama_kv_heads(tensor, kv, split):
    """8 kv heads divide tensor 2 and 4 (split), 2 do not divide 4 or 8 (replicated): so do the shrunk ones."""
    c = config_lib.base_config()
    c.model.update(family='llama', num_layers=4, d_model=256, num_heads=16, num_kv_heads=kv, multiple_of=64)
    c.mesh.update(tensor=tensor, fsdp=2, pipeline=2)
    c.train.update(global_batch=8, micro_batch=2, accum_steps=2)
    s = shrink_lib.shrink(c)
    m = s.config.model
    assert (m.d_model // m.num_heads) % 2 == 0 and m.mlp_dim % tensor == 0
    assert (dict(config_lib.sharding_rules(s.config))['kv_heads'] == 'tensor') == split
    config_lib.validate(shrink_lib.reference_config(s.config), 1)


def test_shrink_refuses_a_mesh_too_large_even_with_data_1():
    c = _paper('1t')
    with pytest.raises(ConfigError, match='even with data 1'):
        shrink_lib.shrink(c, max_devices=256)


def test_verify_cli_rejects_a_bad_config_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, '-m', 'jaxfrontier.main', '--mode=verify', '--config.model.num_heads=5',
                           f'--workdir={tmp_path}'], cwd=processes.REPO, env=processes.subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith('error: config.model.d_model')


def _small(**mesh):
    c = config_lib.base_config()
    c.model.update(num_layers=2, d_model=64, num_heads=8, seq_len=32, vocab_size=256, dtype='float32', remat='full')
    c.mesh.update(**mesh)
    dp = c.mesh.data * c.mesh.fsdp
    c.train.update(micro_batch=2, accum_steps=2, global_batch=4 * dp)
    c.data.kind = 'synthetic'
    return c


@pytest.mark.slow
def test_certificate_fails_naming_the_gradients_when_the_reduction_is_doubled(monkeypatch):
    """A data-parallel reduction that sums instead of averaging (injected here, not in the product)."""
    monkeypatch.setattr(reduction.jax.lax, 'pmean', lambda x, axis: jax.lax.psum(x, axis))
    cert = verify.certificate('broken', shrink_lib.shrink(_small(data=4, tensor=2), max_devices=8))
    assert not cert['passed']
    q = cert['quantities']
    assert not q['loss']['passed'] and not q['grads']['passed'], verify.summary(cert)
    assert q['grads']['worst_relative_difference'] > 0.5
    assert 'FAIL' in verify.summary(cert).split(':')[1]


@pytest.mark.slow
@pytest.mark.parametrize('schedule, virtual', [('interleaved', 2)])
def test_certificate_passes_for_pipeline_schedules(schedule, virtual):
    """Interleaved: the certificate's pipeline path with its [V, L / V] blocks put back in model order.

    Plain 1F1B is the same path with V = 1 (no reordering); its layout is held against one device
    by tests/pipeline/test_pipeline.py (1f1b, pipeline 2 x tensor 2, in the fast tier).
    """
    c = _small(pipeline=2, data=2, tensor=2)
    c.model.num_layers = 8  # shrunk to one layer per chunk: 2 x virtual
    c.pipeline.update(schedule=schedule, virtual_stages=virtual)
    cert = verify.certificate(schedule, shrink_lib.shrink(c, max_devices=8))
    assert cert['passed'], verify.summary(cert)
    assert cert['shrunk']['model.num_layers'] == [8, 2 * virtual]
    assert cert['kept']['pipeline.schedule'] == schedule and cert['kept']['pipeline.virtual_stages'] == virtual


def _llama(arg):
    spec = importlib.util.spec_from_file_location('config_llama', os.path.join(processes.REPO, 'configs', 'llama.py'))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(arg)


LLAMA_CHOICES = ('model.family', 'model.qkv_bias', 'model.norm_eps', 'model.rope_theta', 'model.rope_scaling',
                 'model.rope_factor', 'model.rope_low_freq_factor', 'model.rope_high_freq_factor',
                 'model.rope_original_max_len', 'model.tied_embeddings', 'mesh.tensor', 'mesh.fsdp', 'mesh.pipeline',
                 'sharding.zero1', 'model.remat', 'model.dtype')


@pytest.mark.parametrize('arg, heads, kv', [
    ('size=8b,layout=frontier', 4, 1),  # 32 heads / 8 kv heads on tensor 1: ratio 4 kept
    ('size=70b,layout=frontier', 16, 2),  # 64 / 8 on tensor 2: split (8 % 2 == 0), so 2 of 16
    ('size=405b,layout=frontier', 32, 2),  # 128 / 8 on tensor 2: split, ratio 16
    ('size=tiny,tensor=4,data=4', 4, 2),  # 4 / 2 on tensor 4: replicated (2 % 4 != 0) and stays so
    ('size=1b,tensor=2,pipeline=2,accum=4', 8, 2),  # tied head kept, 32 / 8 on tensor 2
])
def test_shrink_keeps_every_llama_choice(arg, heads, kv):
    c = _llama(arg)
    c.model.qkv_bias, c.model.norm_eps, c.model.rope_theta = True, 1e-6, 1e6  # choices the shrink must keep
    s = shrink_lib.shrink(c)
    m, small = c.model, s.config.model
    for field in LLAMA_CHOICES:
        section, key = field.split('.')
        assert s.config[section][key] == c[section][key], field
        assert field in s.kept, field
    assert (small.num_heads, small.num_kv_heads) == (heads, kv), arg
    assert small.num_heads // small.num_kv_heads == m.num_heads // m.num_kv_heads
    tensor = c.mesh.tensor
    assert (small.num_kv_heads % tensor == 0) == (m.num_kv_heads % tensor == 0)
    assert s.kept['key/value heads split over tensor'] == (m.num_kv_heads % tensor == 0)
    assert small.num_heads % tensor == 0 and (small.d_model // small.num_heads) % 2 == 0  # RoPE pairs
    small_mlp, mlp = config_lib.mlp_dim(s.config), config_lib.mlp_dim(c)
    assert small_mlp % tensor == 0 and abs(small_mlp / small.d_model - mlp / m.d_model) <= tensor / small.d_model
    assert small.num_layers <= m.num_layers and small.d_model < m.d_model and small.vocab_size < m.vocab_size
    reference = shrink_lib.reference_config(s.config)
    config_lib.validate(reference, 1)
    # The one-device reference pads the vocabulary as the layout does: an untied head [d, V] drawn
    # at another padded V starts from other values (the certificate then compared two models).
    assert config_lib.padded_vocab(reference) == config_lib.padded_vocab(s.config)


@pytest.mark.slow
def test_certificate_passes_for_a_llama_layout():
    """Grouped k/v heads replicated over tensor 4 (2 of 4 heads), Llama 3.1 RoPE scaling, untied head, fsdp 2."""
    c = _llama('size=tiny,tensor=4,fsdp=2')
    c.model.remat = 'full'
    cert = verify.certificate('llama', shrink_lib.shrink(c, max_devices=8))
    assert cert['passed'], verify.summary(cert)
    assert cert['kept']['model.family'] == 'llama' and not cert['kept']['key/value heads split over tensor']
    assert cert['kept']['model.rope_scaling'] == 'llama3' and cert['devices'] == 8


@pytest.mark.parametrize('devices, per_process, files, count', [
    (128, 256, 1024, 1),  # configs/175b.py: one process, as before (no gloo, no sockets)
    (256, 256, 1 << 20, 1), (512, 256, 1 << 20, 2),  # configs/1t.py at data 1
    (512, 256, 20_000, 32),  # ... where 20,000 files are allowed: 16 x 511 sockets fit, 32 x 511 do not
    (1536, 256, 1 << 20, 6),  # configs/1t.py at the default --verify_max_devices (data 3)
    (8, 4, 20_000, 2),  # the tests below
    (14, 4, 1 << 20, 7),  # 4 processes cannot split 14 evenly: the next count that does
])
def test_process_count_splits_the_devices_evenly_within_the_open_files(devices, per_process, files, count):
    assert fanout.process_count(devices, per_process, files) == count
    assert devices % count == 0 and devices // count <= per_process
    assert count == 1 or fanout.sockets_per_process(devices, count) <= fanout.FILES_SHARE * files


# configs/tiny.py (data 2 x fsdp 2 x tensor 2) with 2 micro-batches, so that the gradients cross
# `data` in one pmean (training/reduction.py), and ZeRO-1, so that the optimizer state is split
# over both processes too.
TWO_PROCESSES = ('--config=configs/tiny.py', '--config.train.accum_steps=2', '--config.train.micro_batch=2',
                 '--config.sharding.zero1=True')
# The wrong reduction of the test above, in each process of the check (Python runs sitecustomize
# at start-up): a sum where the mean belongs.
SUM_NOT_MEAN = 'import jax\njax.lax.pmean = lambda x, axis, **kw: jax.lax.psum(x, axis)\n'


def _verify_in_processes(tmp_path, inject=''):
    """`--mode=verify` through the CLI with at most 4 devices a process: 2 processes for tiny's 8."""
    env = processes.subprocess_env(JF_VERIFY_PER_PROCESS_MAX='4')
    if inject:
        (tmp_path / 'sitecustomize.py').write_text(inject)
        env['PYTHONPATH'] = f'{tmp_path}{os.pathsep}{env["PYTHONPATH"]}'
    out = tmp_path / 'certificate.json'
    proc = subprocess.run([sys.executable, '-m', 'jaxfrontier.main', '--mode=verify', *TWO_PROCESSES,
                           f'--verify_json={out}', f'--workdir={tmp_path}'], cwd=processes.REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stderr[-4000:]
    cert = json.loads(out.read_text())
    assert cert['processes'] == 2 and cert['devices'] == 8, cert
    assert 'mode=verify: 2 local processes' in proc.stderr
    return proc, cert


@pytest.mark.slow
def test_certificate_passes_in_two_processes(tmp_path):
    proc, cert = _verify_in_processes(tmp_path)
    assert proc.returncode == 0 and cert['passed'], proc.stdout[-3000:] + proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith('verify: PASS') and '(8 cpu devices in 2 processes,' in line and 'ZeRO-1' in line


@pytest.mark.slow
def test_certificate_fails_in_two_processes_when_the_reduction_is_doubled(tmp_path):
    proc, cert = _verify_in_processes(tmp_path, inject=SUM_NOT_MEAN)
    assert proc.returncode == 1 and not cert['passed'], proc.stderr[-3000:]
    q = cert['quantities']
    assert not q['grads']['passed'] and q['grads']['worst_relative_difference'] > 0.5, q
    assert 'FAIL' in proc.stdout.strip().splitlines()[-1].split(':')[1]


@pytest.mark.slow
def test_a_dead_worker_ends_the_check_with_one_line(tmp_path):
    """Process 1 dies at start-up (injected); the parent ends process 0, which would wait for it, and says so."""
    env = processes.subprocess_env(JF_VERIFY_PER_PROCESS_MAX='4')
    (tmp_path / 'sitecustomize.py').write_text("import os, sys\nif os.environ.get('JF_VERIFY_WORKER', '')"
                                               ".startswith('1/'):\n    print('worker 1 dies', file=sys.stderr)\n"
                                               "    os._exit(7)\n")
    env['PYTHONPATH'] = f'{tmp_path}{os.pathsep}{env["PYTHONPATH"]}'
    proc = subprocess.run([sys.executable, '-m', 'jaxfrontier.main', '--mode=verify', *TWO_PROCESSES,
                           f'--workdir={tmp_path}'], cwd=processes.REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 7, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == 'error: verify process 1 of 2 ended with status 7: worker 1 dies'
    assert 'verify: PASS' not in proc.stdout


def test_verify_refuses_in_one_line_when_the_open_files_need_too_many_processes(tmp_path):
    """configs/1t.py at data 1 under a limit of 4,096 open files: 511 gloo sockets per device allow 4
    devices a process, 128 processes; refused before any process starts (no JAX import, a second)."""
    cmd = (f'ulimit -n 4096 && exec {sys.executable} -m jaxfrontier.main --config=configs/1t.py --mode=verify '
           f'--verify_max_devices=512 --workdir={tmp_path}')
    proc = subprocess.run(['bash', '-c', cmd], cwd=processes.REPO, env=processes.subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line, = proc.stderr.strip().splitlines()
    assert line.startswith('error: --mode=verify: 512 simulated devices would need 128 local processes here '
                           '(the open-files limit 4096'), line
    assert 'nofile=261632' in line
