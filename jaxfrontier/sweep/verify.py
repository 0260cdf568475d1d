"""`--verify`: every distinct layout of a sweep checked against one device before trials run.

Each check is `python -m jaxfrontier.main --mode=verify` with the trial's own config and
overrides (a process of its own: the simulated device count is fixed when JAX starts), on the
CPU of the sweep's parent. Trials whose shrunk configs are equal (they differ only in what
the shrink replaces: sizes, batch, steps) share one check. A failing layout's trials are
recorded as `skipped_verify` with the certificate's line; the certificates are kept in
`<workdir>/verify/<id>.json`.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from typing import Any, Callable, Sequence

import ml_collections

from jaxfrontier.plan import shrink as shrink_lib  # no JAX
from jaxfrontier.sweep.trials import Trial


def verifier(python: Sequence[str], env: dict[str, str], workdir: str, config_spec: str, timeout_s: float,
             log: Callable[[str], None] = print) -> Callable[[Trial, ml_collections.ConfigDict], dict[str, Any]]:
    """`check(trial, config) -> {'passed', 'line', 'certificate'}`, one process per distinct shrunk config."""
    done: dict[str, dict[str, Any]] = {}
    out_dir = os.path.join(workdir, 'verify')
    os.makedirs(out_dir, exist_ok=True)
    env = dict(env, JAX_PLATFORMS='cpu')

    def check(trial: Trial, c: ml_collections.ConfigDict) -> dict[str, Any]:
        key = hashlib.sha256(shrink_lib.shrink(c).config.to_json(sort_keys=True).encode()).hexdigest()[:12]
        if key in done:
            return done[key]
        path = os.path.join(out_dir, f'{key}.json')
        cmd = [*python, '-m', 'jaxfrontier.main', f'--config={config_spec}', *trial.args, '--mode=verify',
               f'--verify_json={path}', f'--workdir={out_dir}']
        log(f'verify {key}: checking the layout of trial {trial.trial_id} against one device')
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
            lines = [ln for ln in proc.stdout.splitlines() + proc.stderr.splitlines() if ln.strip()]
            verdict = next((ln for ln in reversed(lines) if ln.startswith(('verify:', 'error:'))),
                           lines[-1] if lines else f'exit {proc.returncode}')
            passed = proc.returncode == 0
        except subprocess.TimeoutExpired:
            verdict, passed = f'verify: no verdict within {timeout_s:.0f} s (--trial_timeout)', False
        result = {'passed': passed, 'line': verdict, 'certificate': path if os.path.exists(path) else None}
        log(f'verify {key}: {verdict}')
        done[key] = result
        return result

    return check


def certificate(path: str | None) -> dict[str, Any] | None:
    """A stored certificate, for the report (None where the check wrote none)."""
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
