"""`--mode=eval`: loss, perplexity and bits per byte over a whole token file, every window once, in order.

Windows are consecutive: window w holds tokens [w S, (w + 1) S + 1) and scores its last S, so
every token after the first is predicted exactly once, with the context of its own window
(no overlap). The last, shorter window is padded and its padding weighted 0; batches are
`train.global_batch` windows (the last one padded with empty windows). Bits per byte divide
the summed loss (in bits) by the UTF-8 bytes the scored tokens stand for (text.py). A run
trained with packed documents (its saved data.pack_documents) is scored with its documents kept
apart, and without the predictions from an end-of-text token unless it counted them
(data.boundary_loss; model/packing.py). A run trained with a loss mask (its resolved
data.loss_mask 'on') scores only the predictions the evaluated file's mask counts, where the file
has one (docs/data.md); `loss_mask` in the result says whether it did. A DPO run (train.objective
'dpo') reports its held-out pairs' dpo/* metrics instead (inference/evaluate_dpo.py).
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding

from jaxfrontier import mesh as mesh_lib
from jaxfrontier.data import builtin, token_files
from jaxfrontier.data import loader as data_lib
from jaxfrontier.errors import ConfigError, UserError
from jaxfrontier.inference import evaluate_dpo
from jaxfrontier.inference import load as load_lib
from jaxfrontier.inference import scoring
from jaxfrontier.inference import text
from jaxfrontier.model import packing as packing_lib


def windows(tokens: np.ndarray, start: int, stop: int, seq_len: int):
    """(inputs+targets [seq_len + 1], scored count) of each consecutive window of tokens[start:stop]."""
    for begin in range(start, stop - 1, seq_len):
        piece = np.asarray(tokens[begin:min(begin + seq_len + 1, stop)], np.int32)
        row = np.zeros(seq_len + 1, np.int32)
        row[:len(piece)] = piece
        yield row, len(piece) - 1


def run_packing(run_config: dict) -> packing_lib.Packing | None:
    """The packed documents (its saved data.pack_documents, resolved data.eot_id) and loss mask (its
    resolved data.loss_mask) the run trained with, or None for neither."""
    data = run_config.get('data', {})
    masked = data.get('loss_mask') == 'on'
    if not data.get('pack_documents') or data.get('eot_id', -1) < 0:
        return packing_lib.Packing(None, loss_mask=True) if masked else None
    return packing_lib.Packing(int(data['eot_id']), bool(data.get('boundary_loss', False)), masked)


def make_nll_step(layout, packing: packing_lib.Packing | None = None):
    """`(params, tokens [B, S + 1], weights [B, S]) -> (weighted nll sum, weight sum)`, jitted.

    With `packing`, each window's documents are kept apart as in training (model/packing.py); the
    caller weighs the predictions training did not count 0 (`counted`)."""
    def nll(params, tokens_bt, weights_bt):
        inputs, targets = tokens_bt[:, :-1], tokens_bt[:, 1:]
        seq = None if packing is None or packing.eot_id is None else packing_lib.documents(inputs, packing.eot_id)
        logp_n, _ = scoring.target_logprobs(layout.model_def.bind(params), inputs, targets, seq)
        w_n = weights_bt.reshape(-1)
        return -jnp.sum(logp_n * w_n), jnp.sum(w_n)
    return jax.jit(nll)


def counted(row: np.ndarray, scored: int, packing: packing_lib.Packing | None,
            mask_row: np.ndarray | None = None) -> np.ndarray:
    """Which of a window's predictions [S] are scored: its first `scored`, less (with packing and no
    boundary loss) those from an end-of-text token, which training did not count either, and less
    those of the targets the file's loss mask `mask_row` [S + 1] (1: counts) leaves out."""
    keep = np.arange(len(row) - 1) < scored
    if packing is not None and packing.eot_id is not None and not packing.boundary_loss:
        keep &= row[:-1] != packing.eot_id
    if mask_row is not None:
        keep &= mask_row[1:] == 1
    return keep


def eval_path_error(e: ConfigError, eval_path: str) -> UserError:
    """A token-file error of --eval_path, naming the flag instead of config.data.path."""
    problem = str(e).removeprefix(f'config.{e.field} = {e.value!r}: ').replace('check data.path', 'check --eval_path')
    return UserError(f'--eval_path={eval_path}: {problem}')


def _range(loaded: load_lib.Loaded, eval_path: str, workdir: str, where: str = '') -> tuple[str, int, int, object]:
    """(token file, first token, stop, codec): --eval_path whole, else the run's data.val_path whole, else
    its validation split; each of a kind the run's train.objective reads (data/loader.check_scored_kind).

    `where`: how a message names eval_path (default --eval_path=PATH)."""
    c, vocab = loaded.config, loaded.config.model.vocab_size
    objective = loaded.run_config.get('train', {}).get('objective', 'lm')
    if eval_path:
        try:
            token_file = token_files.open_token_file(eval_path, vocab, seq_len=1)
            data_lib.check_scored_kind(where or f'--eval_path={eval_path}', token_file.header, objective)
            return token_file.path, 0, token_file.num_tokens, text.token_file_codec(eval_path, vocab)
        except ConfigError as e:  # it names config.data.path: the file is --eval_path's here
            raise eval_path_error(e, eval_path) from None
    data = loaded.run_config.get('data', {})
    if data.get('val_path'):  # the run evaluated on held-out files: score the one it names
        entries = data_lib.val_entries(data['val_path'])
        if len(entries) > 1 or entries[0][1] != data['val_path']:
            raise UserError('the run evaluated on several held-out files (data.val_path is a blend). '
                            'Fix: pass --eval_path=FILE.bin to score one file whole.')
        return _range(loaded, data['val_path'], workdir, f'the run\'s data.val_path {data["val_path"]}')
    if data.get('kind') == 'builtin':
        path = builtin.builtin_corpus(data_lib.builtin_cache_dir(data, workdir))  # where the run cached it
    elif data.get('kind') == 'tokens' and data.get('blend'):
        raise UserError('the run blends several token files (data.blend), each with its own validation split. '
                        'Fix: pass --eval_path=FILE.bin to score one file whole.')
    elif data.get('kind') == 'tokens':
        path = data['path']
    else:
        raise UserError('the run has no token file to take a validation split from. Fix: pass --eval_path=FILE.bin.')
    token_file = token_files.open_token_file(path, vocab, seq_len=c.model.seq_len)
    data_lib.check_scored_kind(f'the run\'s data.path {path}', token_file.header, objective)
    start = token_file.num_tokens - int(token_file.num_tokens * data.get('val_fraction', c.data.val_fraction))
    return token_file.path, start, token_file.num_tokens, text.run_codec(data, vocab)


def evaluate(c: ml_collections.ConfigDict, workdir: str, eval_path: str) -> dict[str, float]:
    """Loss (nats/token), perplexity and bits per byte; see the module docstring."""
    loaded = load_lib.load(c, workdir)
    if evaluate_dpo.is_dpo(loaded):  # preference pairs, not a token stream: the run's dpo/* metrics
        return evaluate_dpo.evaluate(loaded, eval_path)
    c, layout = loaded.config, loaded.layout
    path, start, stop, codec = _range(loaded, eval_path, workdir)
    token_file = token_files.open_token_file(path, c.model.vocab_size)
    byte_lengths = codec.byte_lengths(c.model.vocab_size)
    seq_len, batch = c.model.seq_len, c.train.global_batch
    sharding = NamedSharding(layout.mesh, mesh_lib.batch_spec(layout.rules))
    packing = run_packing(loaded.run_config)
    mask = token_file.mask if packing is not None and packing.loss_mask else None
    mask_rows = (m for m, _ in windows(mask, start, stop, seq_len)) if mask is not None else None
    step = make_nll_step(layout, packing)
    total, count, num_bytes, num_windows = 0.0, 0.0, 0, 0
    rows, weights = [], []

    def flush():
        nonlocal total, count
        while len(rows) < batch:
            rows.append(np.zeros(seq_len + 1, np.int32))
            weights.append(np.zeros(seq_len, np.float32))
        nll, n = step(loaded.params, jax.device_put(np.stack(rows), sharding), jax.device_put(np.stack(weights), sharding))
        total, count = total + float(nll), count + float(n)
        rows.clear()
        weights.clear()

    with jax.set_mesh(layout.mesh), mesh_lib.use_rules(layout.rules):
        for row, scored in windows(token_file.tokens, start, stop, seq_len):
            rows.append(row)
            keep = counted(row, scored, packing, None if mask_rows is None else next(mask_rows))
            weights.append(keep.astype(np.float32))
            num_bytes += int(byte_lengths[row[1:][keep]].sum())
            num_windows += 1
            if len(rows) == batch:
                flush()
        if rows:
            flush()
    loss = total / max(count, 1.0)
    return {'loss': loss, 'perplexity': math.exp(min(loss, 700.0)),
            'bits_per_byte': total / math.log(2) / max(num_bytes, 1), 'tokens': int(count), 'bytes': num_bytes,
            'windows': num_windows, 'path': path, 'first_token': start, 'step': loaded.step, 'source': loaded.source,
            'loss_mask': mask is not None}


def report(result: dict[str, float]) -> str:
    return json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in result.items()})
