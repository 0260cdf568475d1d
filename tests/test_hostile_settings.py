"""Issue 48, items 5 and 7: settings that were taken silently or failed late, now one line (exit 2) before work.

- a resume that changes how a mixture-of-experts model routes (top-k, router, renormalisation, routed
  scale, dropless, node-limited groups): refused like an optimizer switch (checkpoint/format.check_routing_matches),
  through a checkpoint and directly; a resume with another dispatch (moe_dispatch, its buffer) is allowed;
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
from jaxfrontier.checkpoint import format as format_lib
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


@pytest.mark.parametrize('changes', [dict(moe_top_k=1), dict(moe_router='sigmoid'), dict(moe_norm_topk=False),
                                     dict(moe_routed_scale=2.5), dict(moe_dropless=False),
                                     dict(moe_groups=2, moe_topk_groups=1)])
def test_resuming_with_other_routing_is_refused(moe_checkpoint, changes):
    field, other = next(iter(changes)), moe_config(**changes)
    with pytest.raises(ConfigError) as e:
        ckpt_lib.Checkpointer(other, moe_checkpoint).restore(target_of(layout_for(other)))
    message, saved = str(e.value), moe_config().model[field]
    assert f'model.{field}' in message and repr(saved) in message and '\n' not in message, message
    assert f'--config.model.{field}={saved}' in message and 'init_params_from' in message, message


def test_resuming_with_another_dispatch_is_allowed(moe_checkpoint):
    """moe_dispatch and its buffer move the same assignments otherwise: not routing, a resume may change them."""
    assert not {'moe_dispatch', 'moe_dispatch_buffer'} & set(moe_lib.ROUTING_FIELDS + moe_lib.SHAPE_FIELDS)
    other = moe_config(moe_dispatch='all_to_all', moe_dispatch_buffer=3.0)
    state = ckpt_lib.Checkpointer(other, moe_checkpoint).restore(target_of(layout_for(other)))
    assert state is not None


# Each routing field changed on resume (the fast tier's direct check: no checkpoint written, nothing compiled):
# (saved, resumed with), the first key of the second the field named.
ROUTING_CHANGES = [
    (dict(), dict(moe_top_k=1)),
    (dict(), dict(moe_router='sigmoid')),
    (dict(), dict(moe_norm_topk=False)),
    (dict(), dict(moe_routed_scale=2.5)),
    (dict(), dict(moe_dropless=False)),
    (dict(), dict(moe_groups=2, moe_topk_groups=1)),
    (dict(moe_groups=2, moe_topk_groups=2), dict(moe_topk_groups=1, moe_groups=2)),
]


def test_every_routing_field_has_a_case():
    assert {next(iter(ours)) for _, ours in ROUTING_CHANGES} == set(moe_lib.ROUTING_FIELDS)


@pytest.mark.parametrize('saved,ours', ROUTING_CHANGES, ids=[next(iter(o)) for _, o in ROUTING_CHANGES])
def test_routing_check_names_the_field_the_saved_value_and_the_fix(saved, ours):
    field, theirs = next(iter(ours)), moe_config(**saved).model[next(iter(ours))]
    with pytest.raises(ConfigError) as e:
        format_lib.check_routing_matches(moe_config(**saved).to_dict(), moe_config(**ours), 'W/2')
    assert str(e.value) == (
        f'config.model.{field} = {ours[field]!r}: the checkpoint W/2 was trained routing with model.{field} = '
        f'{theirs!r} (its router and experts were trained for it). Fix: set --config.model.{field}={theirs} to '
        'resume it, or change it as a fine-tune: a new --workdir with --config.checkpoint.init_params_from=W/2')


def test_routing_check_reads_fields_a_checkpoint_predates_as_they_were_and_skips_the_dispatch():
    old = moe_config().to_dict()
    for field in ('moe_groups', 'moe_topk_groups', 'moe_dropless'):  # saved before the fields existed
        del old['model'][field]
    format_lib.check_routing_matches(old, moe_config(moe_dropless=False), 'W/2')  # not checked
    format_lib.check_routing_matches(old, moe_config(), 'W/2')  # groups off, as they were before they existed
    with pytest.raises(ConfigError, match='trained routing with model.moe_groups = 0'):
        format_lib.check_routing_matches(old, moe_config(moe_groups=2, moe_topk_groups=1), 'W/2')
    saved = moe_config(moe_dispatch='gather', moe_dispatch_buffer=2.0).to_dict()
    other = moe_config(moe_dispatch='ragged', moe_dispatch_buffer=4.0)
    format_lib.check_routing_matches(saved, other, 'W/2')
    format_lib.check_model_matches(saved, other, 'W/2', 'use a new --workdir')


@pytest.mark.parametrize('fields,needle', [
    (dict(moe_chunks=0), 'model.moe_chunks = 0: must be an integer from 1 to 64'),
    (dict(moe_chunks=True), 'model.moe_chunks = True: must be an integer from 1 to 64'),
    (dict(moe_chunks=65), 'model.moe_chunks = 65: must be an integer from 1 to 64'),
    (dict(moe_chunks=2, moe_dispatch='gather'), "model.moe_chunks = 2: chunks the sent dispatches only, not "
                                                "model.moe_dispatch = 'gather'"),
    (dict(moe_chunks=48, moe_dispatch='ragged'), "model.moe_chunks = 48: must divide a device's 16 positions"),
])
def test_moe_chunks_are_checked(fields, needle):
    """model.moe_chunks (the sent dispatch in chunks, model/layers/moe_dispatch.py): one line each."""
    c = make_config(**{**MOE, **fields})
    with pytest.raises(ConfigError) as e:
        config_lib.validate(c)
    assert needle in str(e.value) and 'Fix:' in str(e.value) and '\n' not in str(e.value), str(e.value)


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
