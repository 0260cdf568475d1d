"""Issue 48, items 5 and 7: settings that were taken silently or failed late, now one line (exit 2) before work.

- a resume that changes how a mixture-of-experts model routes (top-k, router, renormalisation, routed
  scale, dropless): refused like an optimizer switch (checkpoint/format.check_routing_matches);
- model.moe_bias_rate above 0.1 and model.moe_capacity_factor above experts / top_k (families/moe.py);
- a divergence of a model whose router bias moves names model.moe_bias_rate before the learning rate;
- --search_devices outside 0..2^20; get_config() returning a FrozenConfigDict or a ConfigDict that is not
  a jaxfrontier config;
- benchmarks/peers.py and profile_step.py: unknown sizes, families, peers and variants, bad counts, an
  unwritable --out, checked before any worker starts.
LoRA's targets on a mixture-of-experts model and lora.* set with rank 0: tests/model/test_lora.py.
"""

import math
import os
import sys

import pytest

from jaxfrontier import config as config_lib
from jaxfrontier.checkpoint import manager as ckpt_lib
from jaxfrontier.errors import ConfigError, LossSpikeError, NonFiniteLossError
from jaxfrontier.families import moe as moe_lib
from jaxfrontier.run.observe import metrics as metrics_lib
from jaxfrontier.training import spikes
import processes
from checkpoint_common import layout_for, make_config, random_state, save_state, target_of

sys.path.insert(0, os.path.join(processes.REPO, 'benchmarks'))
import peers  # noqa: E402  (no JAX or torch at import)
import profile_step  # noqa: E402

MOE = dict(family='llama', num_kv_heads=2, moe_experts=4, moe_top_k=2, moe_mlp_dim=32)
BIASED = dict(MOE, moe_router='sigmoid', moe_router_bias=True, moe_bias_rate=0.01)


def moe_config(**model):
    c = make_config(**{**MOE, **model})
    config_lib.validate(c)
    return c


# --------------------------------------------------------------------------- MoE settings


@pytest.fixture(scope='module')
def moe_checkpoint(tmp_path_factory):
    """A MoE run's checkpoint at step 2 (random state, nothing compiled)."""
    workdir = str(tmp_path_factory.mktemp('moe'))
    c = moe_config()
    save_state(c, workdir, random_state(layout_for(c)), step=2)
    return workdir


@pytest.mark.parametrize('field,value', [('moe_top_k', 1), ('moe_router', 'sigmoid'), ('moe_norm_topk', False),
                                         ('moe_routed_scale', 2.5), ('moe_dropless', False)])
def test_resuming_with_other_routing_is_refused(moe_checkpoint, field, value):
    other = moe_config(**{field: value})
    with pytest.raises(ConfigError) as e:
        ckpt_lib.Checkpointer(other, moe_checkpoint).restore(target_of(layout_for(other)))
    message, saved = str(e.value), moe_config().model[field]
    assert f'model.{field}' in message and repr(saved) in message and '\n' not in message, message
    assert f'--config.model.{field}={saved}' in message and 'init_params_from' in message, message


@pytest.mark.parametrize('fields,needle', [
    (dict(BIASED, moe_bias_rate=0.5), 'model.moe_bias_rate = 0.5: moves the router bias by more than 0.1 a step'),
    (dict(moe_dropless=False, moe_capacity_factor=2.5), 'model.moe_capacity_factor = 2.5: exceeds experts / top_k '
                                                        '= 4 / 2 = 2'),
])
def test_moe_rates_and_capacity_have_bounds(fields, needle):
    c = make_config(**{**MOE, **fields})
    with pytest.raises(ConfigError) as e:
        config_lib.validate(c)
    assert needle in str(e.value) and 'Fix:' in str(e.value) and '\n' not in str(e.value), str(e.value)


def test_capacity_bound_binds_only_without_dropless():
    moe_config(moe_dropless=False, moe_capacity_factor=2.0)  # C = N: the most an expert can receive
    moe_config(moe_top_k=4, moe_capacity_factor=1.25)  # dropless: the factor is unused


def test_divergence_suspects_the_router_bias(tmp_path):
    """With a moving router bias, the NaN stop, the resume hint and the spike stop name it before the lr."""
    c = make_config(**BIASED)
    suspect = moe_lib.divergence_suspect(c.model)
    assert 'model.moe_bias_rate = 0.01' in suspect and '--config.model.moe_bias_rate=0.001' in suspect
    assert moe_lib.divergence_suspect(make_config(**MOE).model) == ''
    with pytest.raises(NonFiniteLossError) as e:
        metrics_lib.check_finite(5, math.nan, suspect)
    message = str(e.value)
    assert message.index('moe_bias_rate') < message.index('lower the learning rate'), message
    checkpointer = ckpt_lib.Checkpointer(c, str(tmp_path / 'wd'))
    full = str(checkpointer.with_resume_hint(e.value))
    assert full.count('model.moe_bias_rate = 0.01') == 1 and 'else a lower learning rate' in full, full
    hint = checkpointer.resume_hint()
    assert hint.startswith('The first suspect is the MoE router bias'), hint
    c.train.update(spike_skip=True, spike_max_rollbacks=0)
    guard = spikes.SpikeGuard(c.train, str(tmp_path / 'wd'), None, suspect)
    guard.recent = [3]
    with pytest.raises(LossSpikeError) as e:
        guard.roll_back(checkpointer, None)
    assert str(e.value).index('moe_bias_rate') < str(e.value).index('lower the learning rate'), str(e.value)


# --------------------------------------------------------------------------- main's flags and config files


def run_main(*args):
    return processes.run_main(*args, tiny=False, timeout=300)


@pytest.mark.parametrize('devices', ['-1', str(2**62)])
def test_search_devices_out_of_range(devices):
    line = processes.error_line(run_main('--config=configs/tiny.py', '--mode=plan', '--search',
                                         f'--search_devices={devices}'))
    assert f'--search_devices={devices}' in line and 'is not a device count' in line and 'Fix:' in line, line


@pytest.mark.parametrize('returned,needle', [
    ('ml_collections.FrozenConfigDict({"a": 1})', 'returned a FrozenConfigDict'),
    ('ml_collections.ConfigDict({"a": 1})', 'without the top-level field(s) checkpoint, data'),
])
def test_get_config_returning_no_jaxfrontier_config(tmp_path, returned, needle):
    config = tmp_path / 'cfg.py'
    config.write_text(f'import ml_collections\n\n\ndef get_config(arg=None):\n    return {returned}\n')
    line = processes.error_line(run_main(f'--config={config}', f'--workdir={tmp_path / "w"}'))
    assert needle in line and 'Fix:' in line, line
    assert not (tmp_path / 'w').exists()


# --------------------------------------------------------------------------- benchmarks' command lines


def bench_error(monkeypatch, capsys, module, *args):
    monkeypatch.setattr(sys, 'argv', [module.__file__, *args])
    with pytest.raises(SystemExit) as e:
        module.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith('error: '), err
    return err


@pytest.mark.parametrize('args,needle', [
    (['--sizes=tiny'], "--sizes=tiny: unknown 'tiny'"),
    (['--families=gpt,mamba'], "unknown 'mamba'"),
    (['--peers=jf,flax'], "unknown 'flax'"),
    (['--rounds=-1'], '--rounds=-1: must be at least 1'),
    (['--steps=-2'], '--steps=-2: must be at least 0'),
    (['--rounds=x'], "invalid int value: 'x'"),
    (['--variant=bad'], '--variant=bad: not label=peer:key=value'),
    (['--variant=x=nope:a=1'], "unknown peer 'nope'"),
    (['--variant=x=jf:model.bogus=1'], 'model.bogus=1 is not section.field=value'),
    (['--variant=x=jf:model.remat=bogus'], "config.model.remat = 'bogus'"),
    (['--variant=x=jax:foo=1'], 'foo=1 sets no field of baseline_jax_gpt.Config'),
    (['--variant=x=torch_eager:model.remat=none'], 'the torch_eager peer takes no config overrides'),
    (['--sizes=llama1b', '--families=gpt'], 'nothing to run'),
    (['--out=/proc/no/such.json'], 'cannot be written'),
])
def test_peers_command_line(monkeypatch, capsys, args, needle):
    monkeypatch.setattr(peers, 'run_group', lambda *a: pytest.fail('a worker started'))
    assert needle in bench_error(monkeypatch, capsys, peers, *args)


@pytest.mark.parametrize('args,needle', [
    (['--size=tiny'], "--size=tiny: unknown 'tiny'"),
    (['--family=mamba'], "unknown 'mamba'"),
    (['--steps=0'], '--steps=0: must be at least 1'),
    (['--override=model.bogus=1'], 'model.bogus=1 is not section.field=value'),
    (['--torch', '--override=model.remat=none'], 'the torch_compile peer takes no config overrides'),
    (['--out=/proc'], '--out=/proc is a directory'),
])
def test_profile_step_command_line(monkeypatch, capsys, args, needle):
    monkeypatch.setattr(profile_step, 'profile_jf', lambda *a: pytest.fail('profiled'))
    assert needle in bench_error(monkeypatch, capsys, profile_step, *args)
