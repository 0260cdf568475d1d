"""Start-up and sampling print nothing a user cannot act on: JAX's backend probing, Orbax's INFO chatter
and XLA's involuntary-rematerialization warnings are gone; a warning about the run still shows."""

import logging
import subprocess
import sys

import jax
import pytest

from jaxfrontier import config as config_lib
from jaxfrontier import logs
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.checkpoint import manager as ckpt_lib
from jaxfrontier.training import state as ts
import processes
from test_inference import small_config

NOISE = ("Unable to initialize backend", "Involuntary full rematerialization", "BasePyTreeCheckpointHandler",
         "throughput", "gbytes_per_sec", "Read ratio")


def test_library_info_is_quiet_and_their_warnings_show():
    root, level = logging.getLogger(), logging.getLogger().level
    root.setLevel(logging.INFO)  # what main's absl verbosity sets
    try:
        logs.quiet_library_logs()
        for name in logs.QUIET_LOGGERS:
            logger = logging.getLogger(name)
            assert not logger.isEnabledFor(logging.INFO) and logger.isEnabledFor(logging.WARNING), name
        assert logging.getLogger('jax._src.distributed').isEnabledFor(logging.INFO)  # joining a job still reports
    finally:
        root.setLevel(level)


@pytest.mark.slow  # writes an Orbax checkpoint, then a sampling run compiles on 8 simulated devices
def test_sample_stderr_has_no_library_noise(tmp_path):
    c = small_config()
    c.mesh.update(data=1, fsdp=1, tensor=1)
    c.checkpoint.async_save = False
    layout = ts.make_placement(c, mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:1]))
    ckpt = ckpt_lib.Checkpointer(c, str(tmp_path / 'run'))
    ckpt.save(1, ts.init_train_state(c, layout), force=True)
    ckpt.close()
    # data 2 x fsdp 2 x tensor 2: the GPT position embedding split over fsdp is where XLA rematerialised
    proc = subprocess.run([sys.executable, '-m', 'jaxfrontier.main', '--config=configs/tiny.py', '--mode=sample',
                           f'--workdir={tmp_path / "run"}', '--prompt=hi', '--prompt=def f', '--max_new_tokens=3',
                           '--top_k=999'], cwd=processes.REPO, env=processes.subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and '--top_k=999' in proc.stderr  # a user's mistake still shows
    proc = subprocess.run([sys.executable, '-m', 'jaxfrontier.main', '--config=configs/tiny.py', '--mode=sample',
                           f'--workdir={tmp_path / "run"}', '--prompt=hi', '--prompt=def f', '--max_new_tokens=3'],
                          cwd=processes.REPO, env=processes.subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count('--- prompt:') == 2
    noisy = [line for line in proc.stderr.splitlines() if any(n in line for n in NOISE)]
    assert not noisy, noisy
