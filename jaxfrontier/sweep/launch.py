"""Where trials run: this machine (one at a time) or `srun` steps inside a Slurm allocation.

Inside an allocation a trial of D devices is D / devices_per_task tasks (one process per GPU,
as launch/slurm.sbatch runs training) on ceil(tasks / tasks_per_node) nodes. The launcher
keeps a map of free task slots per node and starts a trial when it fits: several trials at
once when the allocation is larger than one, each pinned to its own nodes (or its own share
of a node) with `--nodelist` and `--exclusive`, so steps never share a GPU.

No JAX here.
"""

from __future__ import annotations

import math
import re
import subprocess
from typing import Mapping, Sequence

from jaxfrontier.errors import UserError
from jaxfrontier.sweep.trials import Trial


class LocalLauncher:
    """Trials on this machine, one at a time: they would compete for the same devices."""

    name = 'local'

    def __init__(self, python: Sequence[str]):
        self.python, self.busy = list(python), False

    def unrunnable(self, trial: Trial) -> str | None:
        return None

    def capacity(self, devices: int) -> int:
        return 1

    def start(self, trial: Trial) -> list[str] | None:
        """The command prefix that runs `python -m ...` for this trial, or None while busy."""
        if self.busy:
            return None
        self.busy = True
        return list(self.python)

    def release(self, trial: Trial) -> None:
        self.busy = False


def _tasks_per_node(env: Mapping[str, str]) -> int | None:
    for key in ('SLURM_NTASKS_PER_NODE', 'SLURM_TASKS_PER_NODE'):
        match = re.match(r'\d+', env.get(key, ''))
        if match:
            return int(match.group())
    return None


def _cpus_per_task(env: Mapping[str, str], tasks_per_node: int) -> int:
    """The allocation's --cpus-per-task, else its CPUs on a node shared by the tasks (srun's -c)."""
    for key, divisor in (('SLURM_CPUS_PER_TASK', 1), ('SLURM_CPUS_ON_NODE', tasks_per_node)):
        match = re.match(r'\d+', env.get(key, ''))
        if match:
            return max(1, int(match.group()) // divisor)
    return 1


def allocation_nodes(env: Mapping[str, str]) -> list[str]:
    """Host names of the allocation (`scontrol show hostnames $SLURM_JOB_NODELIST`)."""
    nodelist = env.get('SLURM_JOB_NODELIST') or env.get('SLURM_NODELIST')
    if not env.get('SLURM_JOB_ID') or not nodelist:
        raise UserError(
            '--launcher=slurm: not inside a Slurm allocation (no SLURM_JOB_ID / SLURM_JOB_NODELIST). Fix: submit '
            'launch/sweep.sbatch, or run the sweep inside salloc; elsewhere use --launcher=local')
    out = subprocess.run(['scontrol', 'show', 'hostnames', nodelist], capture_output=True, text=True, check=True,
                         env=dict(env))
    return out.stdout.split()


class SlurmLauncher:
    """Trials as `srun` steps of the current allocation, as many at once as fit."""

    name = 'slurm'

    def __init__(self, python: Sequence[str], nodes: Sequence[str], tasks_per_node: int, devices_per_task: int,
                 gpus: bool, gpu_bind: str = 'closest', cpus_per_task: int = 1):
        if tasks_per_node < 1 or devices_per_task < 1:
            raise UserError(f'--tasks_per_node={tasks_per_node}, --devices_per_task={devices_per_task}: '
                                       'must be >= 1. Fix: give the processes per node and the devices per process')
        self.python, self.nodes = list(python), list(nodes)
        self.tasks_per_node, self.devices_per_task = tasks_per_node, devices_per_task
        self.gpus, self.gpu_bind, self.cpus_per_task = gpus, gpu_bind, max(1, cpus_per_task)
        self.free = {node: tasks_per_node for node in self.nodes}
        self.held: dict[str, dict[str, int]] = {}

    @classmethod
    def from_env(cls, env: Mapping[str, str], python: Sequence[str], tasks_per_node: int, devices_per_task: int,
                 gpus: bool) -> SlurmLauncher:
        nodes = allocation_nodes(env)
        tpn = tasks_per_node or _tasks_per_node(env)
        if not tpn:
            raise UserError('--launcher=slurm: the allocation does not say its tasks per node '
                                       '(SLURM_NTASKS_PER_NODE). Fix: pass --tasks_per_node=N (processes per node, one '
                                       'per GPU) or submit with sbatch --ntasks-per-node=N')
        return cls(python, nodes, tpn, devices_per_task, gpus, cpus_per_task=_cpus_per_task(env, tpn))

    def shape(self, trial: Trial) -> tuple[int, int]:
        """(tasks, nodes) of a trial."""
        tasks = trial.devices // self.devices_per_task
        return tasks, math.ceil(tasks / self.tasks_per_node)

    def capacity(self, devices: int) -> int:
        """How many trials of `devices` devices run at once in this allocation."""
        tasks = max(1, devices // self.devices_per_task)
        if tasks <= self.tasks_per_node:
            return len(self.nodes) * (self.tasks_per_node // tasks)
        return max(1, len(self.nodes) // math.ceil(tasks / self.tasks_per_node))

    def unrunnable(self, trial: Trial) -> str | None:
        """Why this allocation can never run `trial`, or None."""
        tasks, nodes = self.shape(trial)
        if trial.devices % self.devices_per_task:
            return (f'{trial.devices} devices do not split into processes of --devices_per_task='
                    f'{self.devices_per_task}')
        if nodes > len(self.nodes):
            return f'needs {nodes} nodes of {self.tasks_per_node} tasks; the allocation has {len(self.nodes)}'
        if nodes > 1 and tasks % self.tasks_per_node:
            return f'{tasks} tasks over {nodes} nodes is not whole nodes of {self.tasks_per_node} tasks'
        return None

    def start(self, trial: Trial) -> list[str] | None:
        """The `srun ... python` prefix of a trial on free nodes, or None until some are free."""
        tasks, nodes = self.shape(trial)
        if nodes == 1:
            hosts = [n for n in self.nodes if self.free[n] >= tasks][:1]
        else:
            hosts = [n for n in self.nodes if self.free[n] == self.tasks_per_node][:nodes]
        if len(hosts) < nodes:
            return None
        per_node = min(tasks, self.tasks_per_node)
        self.held[trial.trial_id] = {h: per_node for h in hosts}
        for h in hosts:
            self.free[h] -= per_node
        return srun_command(self.python, trial.trial_id, tasks, hosts, per_node,
                            self.devices_per_task if self.gpus else 0, self.gpu_bind, self.cpus_per_task)

    def release(self, trial: Trial) -> None:
        for host, n in self.held.pop(trial.trial_id, {}).items():
            self.free[host] += n


def srun_command(python: Sequence[str], tid: str, tasks: int, hosts: Sequence[str], per_node: int,
                 gpus_per_task: int, gpu_bind: str, cpus_per_task: int = 1) -> list[str]:
    """One trial's job step: its nodes, one process per GPU with its cores, killed whole when one task fails."""
    cmd = ['srun', f'--job-name=trial-{tid}', f'--nodes={len(hosts)}', f'--ntasks={tasks}',
           f'--ntasks-per-node={per_node}', f'--cpus-per-task={cpus_per_task}', f'--nodelist={",".join(hosts)}',
           '--exclusive', '--kill-on-bad-exit=1']
    if gpus_per_task:
        cmd += [f'--gpus-per-task={gpus_per_task}', f'--gpu-bind={gpu_bind}']
    return cmd + list(python)
