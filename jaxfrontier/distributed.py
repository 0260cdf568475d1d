"""Multi-process start-up: `jax.distributed` from Slurm, from explicit settings, or not at all.

One process per GPU (a GCD on Frontier) is the default. `resolve` turns `config.distributed`
and the launcher's environment into `ProcessSettings` without importing JAX, so that `main`
can size the simulated CPU devices per process first; `initialize` then starts
`jax.distributed` with the configured initialisation and heartbeat timeouts, so a dead peer
ends the job instead of hanging it.

This module reads the environment that launchers set (Slurm's `SLURM_*`, and the visible-GPU
variables `HIP_VISIBLE_DEVICES`, `CUDA_VISIBLE_DEVICES`, `ROCR_VISIBLE_DEVICES`): reading it
is its job. Everything else about the run comes from the config (`main` owns the flags).

Modes (`config.distributed.mode`):
  auto: `slurm` inside an `srun` step (one task: `none`), else `explicit` when
    `coordinator_address` is set, else `none`.
  slurm: process count and id from `SLURM_STEP_NUM_TASKS` / `SLURM_PROCID`; the coordinator
    is the step's first node, on `coordinator_port` or a port derived from the job and step.
  explicit: `coordinator_address` (host or host:port), `coordinator_port`, `num_processes`,
    `process_id` and optionally `local_device_ids` from the config (e.g. `launch/local.sh`).
  none: one process, no coordinator.

GPU selection under Slurm (process per GPU): if the launcher bound this task to exactly
`devices_per_process` GPUs (`srun --gpu-bind=closest` sets `ROCR_VISIBLE_DEVICES` or
`CUDA_VISIBLE_DEVICES` per task), the process uses all it sees; if it sees the whole node, it
takes `devices_per_process` GPUs starting at `SLURM_LOCALID * devices_per_process`. JAX's own
Slurm detection always takes GPU number `SLURM_LOCALID`, which does not exist in a process that
was bound to one GPU; hence this module.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from jaxfrontier.errors import ConfigError, DistributedError, UserError

# Innermost first: HIP indexes inside ROCR's set, and HIP also honours CUDA_VISIBLE_DEVICES.
VISIBLE_DEVICE_VARS = ('HIP_VISIBLE_DEVICES', 'CUDA_VISIBLE_DEVICES', 'ROCR_VISIBLE_DEVICES')
_SLURM_STEP_VARS = ('SLURM_JOB_ID', 'SLURM_PROCID', 'SLURM_LOCALID')
_PORT_BASE, _PORT_RANGE = 61440, 4096  # ephemeral ports 61440..65535, as JAX's Slurm detection


@dataclasses.dataclass(frozen=True)
class ProcessSettings:
    """How this process joins the job.

    Attributes:
      mode: the resolved mode: 'slurm', 'explicit' or 'none'.
      num_processes: processes in the job (1 for mode 'none').
      process_id: this process's id in [0, num_processes).
      coordinator_address: 'host:port' of process 0's coordinator; None for one process.
      local_device_ids: ids, among the devices this process can see, that it uses; None: all.
    """

    mode: str
    num_processes: int = 1
    process_id: int = 0
    coordinator_address: str | None = None
    local_device_ids: tuple[int, ...] | None = None

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1


# --------------------------------------------------------------------------- environment


def visible_gpus(env: Mapping[str, str]) -> tuple[str, ...] | None:
    """The GPUs this process can see per the innermost visible-device variable; None if unset."""
    for var in VISIBLE_DEVICE_VARS:
        if var in env:
            return tuple(x for x in env[var].split(',') if x.strip())
    return None


def in_slurm_step(env: Mapping[str, str]) -> bool:
    """True inside an `srun` step.

    A batch script is not one (it has no SLURM_STEP_ID) although it has SLURM_PROCID and
    SLURM_NTASKS: taken for task 0 of SLURM_NTASKS, it would wait for its peers forever.
    """
    return all(v in env for v in _SLURM_STEP_VARS) and _slurm_tasks(env) is not None


def _slurm_tasks(env: Mapping[str, str]) -> int | None:
    value = env.get('SLURM_STEP_NUM_TASKS') if 'SLURM_STEP_ID' in env else None
    return int(value) if value else None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: 'frontier[00012-00015,00020],login1' -> 'frontier00012'."""
    first = re.match(r'([^,\[]*)(?:\[([^\]]*)\]([^,]*))?', nodelist.strip())
    if first is None or not first.group(0):
        raise DistributedError(f'cannot read a host from the Slurm node list {nodelist!r}')
    prefix, ranges, suffix = first.groups()
    return prefix if ranges is None else prefix + re.split(r'[-,]', ranges)[0] + suffix


def slurm_port(env: Mapping[str, str]) -> int:
    """A coordinator port derived from the job and step ids, so concurrent steps differ."""
    job, step = int(env['SLURM_JOB_ID']), int(env.get('SLURM_STEP_ID', '0') or 0)
    return _PORT_BASE + (job * 7 + step) % _PORT_RANGE


def slurm_local_device_ids(env: Mapping[str, str], devices_per_process: int) -> tuple[int, ...] | None:
    """Which of the GPUs it sees this Slurm task uses (process per GPU when devices_per_process=1).

    Args:
      env: the environment (SLURM_LOCALID and the visible-device variables).
      devices_per_process: GPUs per process; 0 means every GPU the process sees.

    Returns:
      Device ids relative to the visible set, or None for all visible devices.

    Raises:
      ConfigError: naming distributed.devices_per_process, when the visible GPUs cannot give
        this task its share.
    """
    if devices_per_process == 0:
        return None
    visible = visible_gpus(env)
    if visible is not None and len(visible) == devices_per_process:
        return None  # the launcher bound this task to its GPUs (--gpu-bind): use them all
    local_id = int(env['SLURM_LOCALID'])
    ids = tuple(range(local_id * devices_per_process, (local_id + 1) * devices_per_process))
    if visible is not None and ids[-1] >= len(visible):
        var = next(v for v in VISIBLE_DEVICE_VARS if v in env)
        raise ConfigError(
            'distributed.devices_per_process', devices_per_process,
            f'Slurm task {local_id} on this node needs GPUs {list(ids)} but sees {len(visible)} ({var}={env[var]})',
            'bind one GPU per task (srun --gpus-per-node=N --ntasks-per-node=N --gpu-bind=closest), or set '
            'distributed.devices_per_process to the GPUs each task gets (0: all it sees)')
    return ids


def parse_device_ids(text: str) -> tuple[int, ...] | None:
    """'' or 'all' -> None (all visible devices); '0,1' -> (0, 1)."""
    text = text.strip()
    if text in ('', 'all'):
        return None
    try:
        return tuple(int(x) for x in text.split(','))
    except ValueError:
        raise ConfigError('distributed.local_device_ids', text, 'must be comma-separated integers',
                          "write e.g. '0' or '0,1', or '' for automatic") from None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (one of another user counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


# --------------------------------------------------------------------------- resolution


def _explicit(d: Any) -> ProcessSettings:
    host, _, port_text = d.coordinator_address.rpartition(':') if ':' in d.coordinator_address else (
        d.coordinator_address, '', '')
    port = int(port_text) if port_text else d.coordinator_port
    if not host:
        raise ConfigError('distributed.coordinator_address', d.coordinator_address,
                          "mode 'explicit' needs the address of process 0",
                          "set it to process 0's host name or IP, e.g. 127.0.0.1 on one machine")
    if not 0 < port < 65536:
        raise ConfigError('distributed.coordinator_port', d.coordinator_port,
                          'the coordinator needs a port', 'set distributed.coordinator_port to a free port, e.g. 12355')
    if d.num_processes < 1:
        raise ConfigError('distributed.num_processes', d.num_processes, "mode 'explicit' needs the process count",
                          'set distributed.num_processes to the number of processes in the job')
    if not 0 <= d.process_id < d.num_processes:
        raise ConfigError('distributed.process_id', d.process_id,
                          f'must be in [0, distributed.num_processes = {d.num_processes})',
                          'give every process its own id 0, 1, ... num_processes - 1')
    return ProcessSettings('explicit', d.num_processes, d.process_id, f'{host}:{port}',
                           parse_device_ids(d.local_device_ids))


def _slurm(d: Any, env: Mapping[str, str], cpu: bool) -> ProcessSettings:
    if not in_slurm_step(env):
        raise ConfigError('distributed.mode', 'slurm', 'this process is not a task of an srun step '
                          '(SLURM_STEP_ID, SLURM_STEP_NUM_TASKS, SLURM_PROCID or SLURM_LOCALID is unset)',
                          "launch with srun (launch/slurm.sbatch), or use mode 'auto' or 'explicit'")
    num_processes, process_id = _slurm_tasks(env), int(env['SLURM_PROCID'])
    if num_processes == 1:
        return ProcessSettings('none')
    nodelist = env.get('SLURM_STEP_NODELIST') or env.get('SLURM_JOB_NODELIST', '')
    port = d.coordinator_port or slurm_port(env)
    if d.local_device_ids:
        local_ids = parse_device_ids(d.local_device_ids)
    else:
        local_ids = None if cpu else slurm_local_device_ids(env, d.devices_per_process)
    return ProcessSettings('slurm', num_processes, process_id, f'{first_host(nodelist)}:{port}', local_ids)


def resolve(d: Any, env: Mapping[str, str], cpu: bool = False) -> ProcessSettings:
    """Decides how this process joins the job; imports no JAX and starts nothing.

    Args:
      d: `config.distributed`.
      env: the process environment (`os.environ`).
      cpu: the job runs on simulated CPU devices (config.mesh.cpu_devices > 0): no GPU selection.

    Returns:
      The resolved ProcessSettings.

    Raises:
      ConfigError: when the mode's settings are missing or inconsistent.
    """
    mode = d.mode
    if mode == 'auto':
        mode = 'slurm' if in_slurm_step(env) else 'explicit' if d.coordinator_address else 'none'
    if mode == 'none':
        return ProcessSettings('none')
    if mode == 'explicit':
        return _explicit(d)
    if mode == 'slurm':
        return _slurm(d, env, cpu)
    raise ConfigError('distributed.mode', mode, 'unknown mode', "use 'auto', 'slurm', 'explicit' or 'none'")


def cpu_devices_per_process(total: int, num_processes: int) -> int:
    """Simulated CPU devices each process creates: config.mesh.cpu_devices is the job's total."""
    if total > 0 and total % num_processes:
        raise ConfigError('mesh.cpu_devices', total,
                          f'the simulated devices of the job must split evenly over its {num_processes} processes',
                          f'set mesh.cpu_devices to a multiple of {num_processes}')
    return total // num_processes


# --------------------------------------------------------------------------- start-up


def wait_for_coordinator(settings: ProcessSettings, timeout_s: float) -> None:
    """Waits until process 0's coordinator accepts TCP connections.

    Raises:
      DistributedError: naming the address, if it does not within timeout_s.
    """
    host, _, port = settings.coordinator_address.rpartition(':')
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host.strip('[]'), int(port)), timeout=min(5.0, timeout_s)).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f'process {settings.process_id} of {settings.num_processes} could not reach the '
                    f'coordinator at {settings.coordinator_address} within '
                    f'config.distributed.initialization_timeout_s = {timeout_s:g} s ({e}). Fix: check that '
                    'process 0 started (its log says why not) and that this host can reach that address '
                    'and port') from None
            time.sleep(0.5)


def initialize(settings: ProcessSettings, d: Any) -> None:
    """Starts `jax.distributed` for a multi-process job; does nothing for one process.

    Must run before anything touches JAX devices. Cross-process CPU collectives use gloo.

    Args:
      settings: from `resolve`.
      d: `config.distributed` (the timeouts).

    Raises:
      DistributedError: when the processes do not all join within initialization_timeout_s.
    """
    if not settings.multi_process:
        return
    if settings.process_id != 0:  # JAX aborts, blaming "another task", when it cannot connect
        wait_for_coordinator(settings, float(d.initialization_timeout_s))
    else:
        check_port_free(settings)
    import jax  # pylint: disable=g-import-not-at-top  (importing this module must not start JAX)

    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        jax.distributed.initialize(
            coordinator_address=settings.coordinator_address, num_processes=settings.num_processes,
            process_id=settings.process_id,
            local_device_ids=list(settings.local_device_ids) if settings.local_device_ids is not None else None,
            cluster_detection_method='deactivate',  # everything is resolved above
            initialization_timeout=int(d.initialization_timeout_s),
            heartbeat_timeout_seconds=int(d.heartbeat_timeout_s), shutdown_timeout_seconds=int(d.shutdown_timeout_s))
        jax.devices()  # the global device exchange: the first point where a missing peer shows
    except Exception as e:  # pylint: disable=broad-except  (XlaRuntimeError has no stable import)
        raise DistributedError(
            f'process {settings.process_id} of {settings.num_processes} could not join the job '
            f'(coordinator {settings.coordinator_address}, {settings.mode} mode, '
            f'timeout {d.initialization_timeout_s} s): {str(e).splitlines()[0] if str(e) else type(e).__name__}. '
            'Fix: check that every process started and that this host can reach the coordinator '
            "(process 0's host and port)") from e
    finally:
        _take_back_sigterm(sigterm)


def _take_back_sigterm(action: Any) -> None:
    """Gives SIGTERM back the action it had before `jax.distributed.initialize`.

    JAX's preemption notifier takes SIGTERM over there (a C++ handler that logs "SIGTERM caught"
    and nothing else we use), and swallowed the signal until the training loop installed its own
    (run/control/preemption.py): a job told to stop before that trained on to its last step. With the
    previous action back, SIGTERM in between (the planner's preflight, imports) ends the process
    as it does with one process: nothing has been trained yet that a checkpoint would keep.
    """
    if action is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, action)


def check_port_free(settings: ProcessSettings) -> None:
    """Process 0: the coordinator's port must not be in use (gRPC binds with SO_REUSEPORT, so two jobs
    given the same port both bound it and their processes met the wrong coordinator, without an error).

    A plain bind (SO_REUSEADDR only, so a closed connection's TIME_WAIT does not count) fails while any
    other socket listens on the port.
    """
    port = int(str(settings.coordinator_address).rsplit(':', 1)[1])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(('', port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return  # no right to bind it here (or no such interface): gRPC reports that itself
            raise DistributedError(
                f'process 0: the coordinator port {port} ({settings.coordinator_address}) is already in use, by '
                'another job or program (two launch/local.sh runs given the same JF_PORT?). Fix: choose a free '
                'port (JF_PORT, config.distributed.coordinator_port), or leave JF_PORT unset for a free one') from None


def check_backend(env: Mapping[str, str]) -> None:
    """Starts JAX's backend; a platform that cannot start (JAX_PLATFORMS=cuda without CUDA) is a UserError.

    JAX itself answers a bare AssertionError (no device of the asked platform is visible) or a
    RuntimeError naming only the failed plugin.
    """
    import jax  # pylint: disable=g-import-not-at-top
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top  (installed backends: no public API)

    try:
        jax.devices()
    except (AssertionError, RuntimeError) as e:
        asked = env.get('JAX_PLATFORMS') or jax.config.jax_platforms or '(any)'
        installed = ', '.join(sorted(xla_bridge._backend_factories)) or 'none'  # pylint: disable=protected-access
        gpus = [name for name, present in (('NVIDIA', os.path.exists('/dev/nvidiactl')),
                                           ('AMD (/dev/kfd)', os.path.exists('/dev/kfd'))) if present]
        detail = f' ({" ".join(str(e).split())})' if str(e) else ''
        raise UserError(
            f'JAX_PLATFORMS={asked}: JAX could not start that platform{detail}; installed JAX backends: '
            f'{installed}; GPUs visible on this host: {", ".join(gpus) or "none"}. Fix: set JAX_PLATFORMS to '
            'one that is present (cpu, or unset it to pick automatically), or run on a node with that '
            'accelerator and its jax plugin (pip install -e .[cuda12] / .[rocm7])') from None


def describe_process(settings: ProcessSettings, env: Mapping[str, str]) -> str:
    """One log line for this process: its id, local and global devices, backend, coordinator, GPUs.

    Args:
      settings: from `resolve`.
      env: the process environment, for the visible-device variables.
    """
    import jax  # pylint: disable=g-import-not-at-top

    check_backend(env)  # the first use of the backend: a platform that cannot start is one line
    local = jax.local_devices()
    ids = ','.join(str(dev.id) for dev in local)
    selection = 'all' if settings.local_device_ids is None else ','.join(map(str, settings.local_device_ids))
    visible = ' '.join(f'{v}={env[v]}' for v in VISIBLE_DEVICE_VARS if v in env) or 'no visible-device variables'
    return (f'process {jax.process_index()}/{jax.process_count()} on {socket.gethostname()}: '
            f'{len(local)} local device(s) [{ids}] of {jax.device_count()} global; '
            f'backend {jax.default_backend()} ({local[0].device_kind}); '
            f'coordinator {settings.coordinator_address or "none"} ({settings.mode}); '
            f'local device ids {selection} ({visible})')
