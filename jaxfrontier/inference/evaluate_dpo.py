"""`--mode=eval` of a DPO run (its saved train.objective 'dpo'): the held-out pairs' DPO metrics.

A DPO run's held-out file holds preference pairs (rows of prompt + response, data/dpo.py), not a
token stream: the language-model loss of inference/evaluate.py would score windows that straddle
rows. So the run's evaluation is reported instead, over every pair of the file once (the run's own
`eval/dpo/*` read `train.eval_batches` batches): the DPO loss, the implicit rewards beta (logp -
ref) of chosen and rejected, their margin and the accuracy (training/dpo.py), with the run's
reference: its start (`checkpoint.init_params_from`, read again) or, under LoRA, the base with the
adapters off (no second copy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxfrontier import mesh as mesh_lib
from jaxfrontier.checkpoint.interop import init_from
from jaxfrontier.data import dpo as dpo_data
from jaxfrontier.data import loader as data_lib
from jaxfrontier.data import token_files
from jaxfrontier.errors import ConfigError, FlagError, UserError
from jaxfrontier.inference import load as load_lib
from jaxfrontier.model import packing as packing_lib
from jaxfrontier.model.context import TokenOrder
from jaxfrontier.model import preference


def is_dpo(loaded: load_lib.Loaded) -> bool:
    """Whether the loaded run trained with train.objective='dpo'."""
    return loaded.run_config.get('train', {}).get('objective') == 'dpo'


def _pairs(loaded: load_lib.Loaded, eval_path: str) -> tuple[str, np.ndarray]:
    """(path, flagged rows [2P, seq_len + 1]) of --eval_path, else the run's data.val_path."""
    path = eval_path or loaded.run_config.get('data', {}).get('val_path', '')
    if not path:
        raise UserError('the DPO run names no held-out pairs (data.val_path). Fix: pass --eval_path=PAIRS_val.bin '
                        '(python -m jaxfrontier.prepare --dpo).')
    where = f'--eval_path={path}' if eval_path else f'the run\'s data.val_path {path}'
    try:
        data_lib.check_scored_kind(where, token_files.open_token_file(path, loaded.config.model.vocab_size).header,
                                   'dpo')
        rows = dpo_data.read_rows(path, loaded.config.model.vocab_size)
    except (ConfigError, FlagError) as e:  # it names data.path: the file is --eval_path's or data.val_path's here
        raise UserError(f'{where}: {str(e).split(": ", 1)[-1]}') from None
    if rows.shape[1] != loaded.config.model.seq_len + 1:
        raise UserError(f'{where} has rows of {rows.shape[1]} tokens, the model seq_len + 1 = '
                        f'{loaded.config.model.seq_len + 1}. Fix: prepare it with the run\'s --seq_len.')
    return path, rows


def evaluate(loaded: load_lib.Loaded, eval_path: str) -> dict:
    """dpo/* over every held-out pair once; see the module docstring."""
    c, layout = loaded.config, loaded.layout
    path, rows = _pairs(loaded, eval_path)
    run = loaded.run_config  # the run's beta and start, whatever this command line says
    beta = run.get('train', {}).get('dpo_beta', c.train.dpo_beta)
    start = run.get('checkpoint', {}).get('init_params_from') or c.checkpoint.init_params_from
    lora = bool(run.get('lora', {}).get('rank'))
    reference = None if lora else init_from.load_params(start, c, layout.target())
    order = TokenOrder(c.model.seq_len, packing=packing_lib.Packing(None, loss_mask=True))
    batch = max(2, c.train.global_batch - c.train.global_batch % 2)
    sharding = NamedSharding(layout.mesh, mesh_lib.batch_spec(layout.rules))
    step = jax.jit(lambda p, r, t: preference.logps(layout.model_def, order, p, r, t))
    policy, ref = [], []
    with jax.set_mesh(layout.mesh), mesh_lib.use_rules(layout.rules):
        for begin in range(0, len(rows), batch):
            chunk = rows[begin:begin + batch]
            padded = np.concatenate([chunk, np.repeat(chunk[:2], (batch - len(chunk)) // 2, axis=0)])
            p_b, r_b = jax.device_get(step(loaded.params, reference, jax.device_put(padded, sharding)))
            policy.append(p_b[:len(chunk)])
            ref.append(r_b[:len(chunk)])
    _, metrics = preference.dpo_loss(jnp.concatenate(policy), jnp.concatenate(ref), beta)
    return {**{k: float(v) for k, v in metrics.items()}, 'pairs': len(rows) // 2, 'path': path, 'step': loaded.step,
            'source': loaded.source, 'reference': 'the base, adapters off (LoRA)' if lora else
            start, 'beta': beta}
