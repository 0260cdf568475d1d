"""Checkpoint throughput: save and restore GiB/s, and how long a save blocks the training loop.

  python benchmarks/checkpoint.py [--quick] [--dir=/tmp/jf_ckpt_bench] [--rounds=2] [--formats=a,b] > checkpoint.jsonl

The train state (parameters + two Adam moments, fp32) of a GPT of 6 layers x 1024 wide with a
32,768-token vocabulary, every array drawn at random as a trained state's are (Adam's moments
are zeros at init, which zstd would shrink to nothing): 1.22 GiB over 8 simulated CPU devices with fsdp 8 (every device
holds 1/8; nothing replicated). `--quick` uses 2 layers x 512 (0.26 GiB) to check the script.

Measured through jaxfrontier.checkpoint.manager.Checkpointer, the code the training loop runs, after
one warm-up of each operation (first-call costs excluded), median of 3:

  blocked_s   time `save()` holds the loop: with async_save, until the arrays are copied off
              the devices (on the CPU backend a host "copy" is a zero-copy view, so this is
              Orbax's bookkeeping; on a GPU it adds the device-to-host copy of the local shards)
  total_s     until the checkpoint is committed (renamed from its temporary directory)
  save GiB/s  state GiB / total_s
  restore     Checkpointer.restore onto the saving mesh (fsdp 8) and onto another one
              (data 2 x fsdp 2 x tensor 2), until every array is ready; GiB/s = state GiB / s

  check_s     the host sync on the step's loss / gradient norm / parameter norm that `save(...,
              metrics=...)` does before committing (a non-finite state is never saved)

Two formats, measured in alternating rounds (ABBA, so a change in the machine's load hits both):
  crc32c      what the checkpointer writes: zarr3 with a CRC32C per chunk (checkpoint/integrity.py)
  before      the format before checksums: Orbax's default zarr2, no checksum on the data
  zarr3_no_crc  (--formats=crc32c,before,zarr3_no_crc) zarr3 + zstd 1 without the CRC32C: the
              format change alone
  crc32c_no_zstd  (likewise) zarr3 chunks with the CRC32C but no compression
disk_gib is the size of one committed step directory.

Numbers depend on the disk and on the page cache: the restore reads files just written, so
it measures TensorStore decode + resharding more than the disk. JSON lines, then a table of
the median over rounds.
"""

import json
import os
import shutil
import statistics
import sys
import time

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from orbax.checkpoint._src.serialization import tensorstore_utils  # noqa: E402

import harness  # noqa: E402
from jaxfrontier.checkpoint import format as format_lib  # noqa: E402
from jaxfrontier.checkpoint import integrity as ckpt_integrity  # noqa: E402
from jaxfrontier.checkpoint import manager as ckpt_lib  # noqa: E402
from jaxfrontier.checkpoint import target as target_lib  # noqa: E402
from jaxfrontier import config as config_lib  # noqa: E402
from jaxfrontier import mesh as mesh_lib  # noqa: E402
from jaxfrontier.training import state as ts  # noqa: E402

REPEATS = 3


def bench_config(quick: bool, data=1, fsdp=8, tensor=1, async_save=True):
    c = config_lib.base_config()
    layers, d_model = (2, 512) if quick else (6, 1024)
    c.model.update(num_layers=layers, d_model=d_model, num_heads=16, seq_len=128, vocab_size=32768,
                   vocab_multiple=128, dtype='float32', remat='none')
    c.mesh.update(data=data, fsdp=fsdp, tensor=tensor)
    c.train.update(global_batch=8, micro_batch=8 // (data * fsdp))
    c.data.kind = 'synthetic'
    c.checkpoint.update(every_steps=1, keep=2, async_save=async_save)
    config_lib.validate(c, jax.device_count())
    return c


def layout_for(c):
    return ts.make_placement(c, mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()))


_STATE_HANDLER = ckpt_lib._state_handler  # pylint: disable=protected-access
ckpt_integrity.install_chunk_checksums()
_WITH_CRC32C = tensorstore_utils._build_zarr3_metadata  # pylint: disable=protected-access


def _zarr3_without_crc32c(*args, **kwargs):
    metadata = _WITH_CRC32C(*args, **kwargs)
    for codec in metadata['codecs']:
        codec['configuration']['codecs'] = [c for c in codec['configuration']['codecs'] if c['name'] != 'crc32c']
    return metadata


_zarr3_without_crc32c.jaxfrontier_checksum = True  # install_chunk_checksums leaves it in place


def _use(build, checksums):
    def handler():
        tensorstore_utils._build_zarr3_metadata = build  # pylint: disable=protected-access
        return _STATE_HANDLER(checksums=checksums)
    return handler


def _zarr3_crc32c_no_zstd(*args, **kwargs):
    metadata = _WITH_CRC32C(*args, **kwargs)
    for codec in metadata['codecs']:
        codec['configuration']['codecs'] = [c for c in codec['configuration']['codecs'] if c['name'] != 'zstd']
    return metadata


_zarr3_crc32c_no_zstd.jaxfrontier_checksum = True


FORMATS = {'crc32c': _use(_WITH_CRC32C, True), 'before': _use(_WITH_CRC32C, False),
           'zarr3_no_crc': _use(_zarr3_without_crc32c, True),
           'crc32c_no_zstd': _use(_zarr3_crc32c_no_zstd, True)}


def trained_like(state):
    """The state with every floating array drawn at random: Adam's moments are zeros at init,
    which zstd shrinks to nothing, while a trained run's moments are as incompressible as its
    parameters."""
    leaves, treedef = jax.tree.flatten(state)

    def fill(leaves):
        keys = jax.random.split(jax.random.key(0), len(leaves))
        return [x + 1e-3 * jax.random.normal(k, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
                for x, k in zip(leaves, keys)]

    out = jax.jit(fill, out_shardings=[x.sharding for x in leaves])(leaves)
    return jax.tree.unflatten(treedef, out)


@jax.jit
def step_metrics(state):
    """Stands in for a train step's metrics: the three scalars the finite check fetches."""
    norm = jnp.sqrt(sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in jax.tree.leaves(state['params'])))
    return {'train/loss': norm * 0 + 2.0, 'train/grad_norm': norm * 0 + 1.0, 'train/param_norm': norm}


def time_saves(c, state, directory, gib, with_metrics=False):
    """Warm-up save, then REPEATS timed saves: (blocked_s, total_s, check_s) each."""
    checkpointer = ckpt_lib.Checkpointer(c, directory)
    times = []
    for step in range(REPEATS + 1):
        metrics = jax.block_until_ready(step_metrics(state)) if with_metrics else None
        start = time.perf_counter()
        if with_metrics:  # what save() does first, timed on its own
            ckpt_integrity.health(metrics)
        check = time.perf_counter() - start
        start = time.perf_counter()
        checkpointer.save(step, state, force=True, metrics=metrics)
        blocked = time.perf_counter() - start
        checkpointer.wait()
        total = time.perf_counter() - start
        if step:
            times.append((blocked, total, check))
    checkpointer.close()
    newest = os.path.join(checkpointer.directory, str(format_lib.committed_steps(checkpointer.directory)[-1]))
    disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(newest) for f in fs)
    blocked_s, total_s, check_s = (statistics.median(t[i] for t in times) for i in range(3))
    return {'blocked_s': blocked_s, 'total_s': total_s, 'check_s': check_s, 'gib_per_s': gib / total_s,
            'disk_gib': disk / 2**30}


def time_restores(c, directory, gib):
    layout = layout_for(c)
    checkpointer = ckpt_lib.Checkpointer(c, directory)
    times = []
    for i in range(REPEATS + 1):
        start = time.perf_counter()
        restored = jax.block_until_ready(checkpointer.restore(
            target_lib.abstract_target(layout.abstract_state, layout.state_shardings)))
        if i:
            times.append(time.perf_counter() - start)
        del restored
    checkpointer.close()
    total_s = statistics.median(times)
    return {'blocked_s': total_s, 'total_s': total_s, 'gib_per_s': gib / total_s}


def one_round(quick, fmt, state, root, gib, emit):
    ckpt_lib._state_handler = FORMATS[fmt]  # pylint: disable=protected-access
    c = bench_config(quick)
    emit({'op': 'save', 'format': fmt, 'async_save': True, 'mesh': 'fsdp8',
          **time_saves(c, state, os.path.join(root, fmt, 'async'), gib, with_metrics=True)})
    emit({'op': 'save', 'format': fmt, 'async_save': False, 'mesh': 'fsdp8',
          **time_saves(bench_config(quick, async_save=False), state, os.path.join(root, fmt, 'sync'), gib)})
    emit({'op': 'restore', 'format': fmt, 'async_save': None, 'mesh': 'fsdp8',
          **time_restores(c, os.path.join(root, fmt, 'async'), gib)})
    emit({'op': 'restore', 'format': fmt, 'async_save': None, 'mesh': 'data2_fsdp2_tensor2',
          **time_restores(bench_config(quick, data=2, fsdp=2, tensor=2), os.path.join(root, fmt, 'async'), gib)})
    shutil.rmtree(os.path.join(root, fmt), ignore_errors=True)


def main():
    quick = '--quick' in sys.argv
    formats = next((a.split('=', 1)[1].split(',') for a in sys.argv[1:] if a.startswith('--formats=')),
                   ['crc32c', 'before'])
    root = next((a.split('=', 1)[1] for a in sys.argv[1:] if a.startswith('--dir=')), '/tmp/jf_ckpt_bench')
    rounds = int(next((a.split('=', 1)[1] for a in sys.argv[1:] if a.startswith('--rounds=')), '2'))
    shutil.rmtree(root, ignore_errors=True)
    c = bench_config(quick)
    state = trained_like(ts.init_train_state(c, layout_for(c)))
    arrays, gib = ckpt_lib.describe_arrays(state)
    common = {'state_gib': gib, 'arrays': arrays, 'devices': jax.device_count(), 'platform': jax.devices()[0].platform}
    rows = []

    def emit(row):
        rows.append({**row, **common})
        print(json.dumps(rows[-1]), flush=True)

    for r in range(rounds):
        for fmt in formats if r % 2 == 0 else reversed(formats):  # ABBA: neither format always goes first
            one_round(quick, fmt, state, root, gib, emit)
    keys = ('op', 'format', 'async_save', 'mesh')
    table = []
    for key in dict.fromkeys(tuple(row[k] for k in keys) for row in rows):
        same = [row for row in rows if tuple(row[k] for k in keys) == key]
        table.append({**same[0], **{k: statistics.median(row[k] for row in same)
                                    for k in ('blocked_s', 'total_s', 'check_s', 'gib_per_s', 'disk_gib')
                                    if k in same[0]}})
    harness.print_table(table, [*keys, 'state_gib', 'disk_gib', 'blocked_s', 'check_s', 'total_s', 'gib_per_s'])
    shutil.rmtree(root, ignore_errors=True)


if __name__ == '__main__':
    main()
