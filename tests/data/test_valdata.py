"""Held-out data whose loss says something about unseen text, through the command lines a user types.

prepare splits a corpus by documents at random (seeded, reproducible to the byte) and can
shuffle them; training evaluates on `data.val_path` (a file or a blend), reports each file's loss,
and warns when its validation split is the tail of an unshuffled stream.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxfrontier import config as config_lib
from jaxfrontier.data import loader, token_files
from jaxfrontier.errors import ConfigError
from jaxfrontier.training import evaluation
from jaxfrontier.run import validation
import processes

REPO = processes.REPO
SEQ_LEN, BATCH = 32, 16  # processes.TINY's sequence and configs/tiny.py's global batch


def _docs(prefix, n):
    """n distinct documents (their first line names them), a few hundred tokens each."""
    return [f'{prefix} document {i}\n' + ''.join(f'line {j} of {prefix} {i}: {"abc " * (i % 5)}{j * i}\n'
                                                for j in range(12)) for i in range(n)]


def _jsonl(path, docs):
    path.write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs))
    return str(path)


def _prepare(*args, check=True):
    done = subprocess.run([sys.executable, '-m', 'jaxfrontier.prepare', *args], cwd=REPO,
                          env=processes.subprocess_env(), capture_output=True, text=True, timeout=300)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def _decoded(bin_path):
    """The documents of a prepared file: the text between its end-of-text tokens."""
    from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
    header = json.load(open(token_files.token_paths(bin_path)[1]))
    token_file = token_files.open_token_file(bin_path, header['vocab_size'])
    tokenizer = Tokenizer.from_file(token_files.tokenizer_path(token_file))
    tokens = np.asarray(token_file.tokens)
    cuts = np.flatnonzero(tokens == header['eot_id'])
    starts = np.concatenate([[0], cuts[:-1] + 1])
    return [tokenizer.decode(tokens[s:e].tolist(), skip_special_tokens=False) for s, e in zip(starts, cuts)]


def _files(directory):
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


# --------------------------------------------------------------------------- prepare


def test_split_is_by_document_at_random_and_reproducible(tmp_path):
    docs = _docs('corpus', 50)
    corpus = _jsonl(tmp_path / 'c.jsonl', docs)
    out = _prepare(f'--input={corpus}', f'--output={tmp_path}/a/c', '--train_tokenizer=400', '--val_fraction=0.2',
                   '--seed=7')
    assert 'c_train.bin: train split by documents (seed 7)' in out.stdout and 'c_val.bin' in out.stdout
    assert sorted(os.listdir(tmp_path / 'a')) == ['c.tokenizer.json', 'c_train.bin', 'c_train.json', 'c_val.bin',
                                                 'c_val.json']
    train, val = _decoded(tmp_path / 'a' / 'c_train.bin'), _decoded(tmp_path / 'a' / 'c_val.bin')
    assert len(val) == 10 and len(train) == 40 and sorted(train + val) == sorted(docs)  # whole documents
    assert train == [d for d in docs if d in train] and val == [d for d in docs if d in val]  # corpus order
    assert val != docs[-10:] and val != docs[:10]  # drawn at random, not a tail or a head
    header = json.load(open(tmp_path / 'a' / 'c_val.json'))
    assert header['documents_shuffled'] is False and header['num_documents'] == 10
    assert header['split'] == {'part': 'val', 'by': 'document', 'seed': 7, 'val_fraction': 0.2, 'val_documents': 10,
                               'train_documents': 40}
    assert header['tokenizer'] == 'c.tokenizer.json'

    _prepare(f'--input={corpus}', f'--output={tmp_path}/b/c', '--train_tokenizer=400', '--val_fraction=0.2',
             '--seed=7')
    assert _files(tmp_path / 'b') == _files(tmp_path / 'a')  # same inputs and seed: the same bytes
    tokenizer = f'--tokenizer={tmp_path}/a/c.tokenizer.json'
    _prepare(f'--input={corpus}', f'--output={tmp_path}/s/c', tokenizer, '--val_fraction=0.2', '--seed=8')
    assert sorted(_decoded(tmp_path / 's' / 'c_val.bin')) != sorted(val)  # another seed, other documents

    _prepare(f'--input={corpus}', f'--output={tmp_path}/h/c', tokenizer, '--val_documents=3', '--shuffle', '--seed=7')
    shuffled_train, shuffled_val = _decoded(tmp_path / 'h' / 'c_train.bin'), _decoded(tmp_path / 'h' / 'c_val.bin')
    assert len(shuffled_val) == 3 and sorted(shuffled_train + shuffled_val) == sorted(docs)
    assert shuffled_train != [d for d in docs if d in shuffled_train]  # not in corpus order
    assert json.load(open(tmp_path / 'h' / 'c_train.json'))['documents_shuffled'] is True

    _prepare(f'--input={corpus}', f'--output={tmp_path}/o/c', tokenizer, '--shuffle')  # shuffled, one file
    assert sorted(os.listdir(tmp_path / 'o')) == ['c.bin', 'c.json', 'c.tokenizer.json']
    everything = _decoded(tmp_path / 'o' / 'c.bin')
    assert sorted(everything) == sorted(docs) and everything != docs


@pytest.mark.parametrize('args,flag', [
    (('--val_fraction=0.1', '--val_documents=2'), '--val_fraction'),
    (('--val_documents=5',), '--val_documents'),  # all five documents: none left to train on
    (('--val_fraction=0.01',), '--val_fraction'),  # 0.05 documents: none
    (('--val_fraction=1.5',), '--val_fraction'),
])
def test_impossible_splits_are_one_line_and_exit_2(tmp_path, args, flag):
    corpus = _jsonl(tmp_path / 'c.jsonl', _docs('x', 5))
    done = _prepare(f'--input={corpus}', f'--output={tmp_path}/o/c', '--train_tokenizer=300', *args, check=False)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert flag in done.stderr and 'Fix:' in done.stderr, done.stderr
    assert not os.path.exists(tmp_path / 'o') or not os.listdir(tmp_path / 'o')


# --------------------------------------------------------------------------- the trainer's checks and warning


def _config(**data):
    c = config_lib.base_config()
    c.model.update(vocab_size=0, seq_len=SEQ_LEN)
    c.data.update(kind='tokens', **data)
    return c


@pytest.fixture(scope='module')
def prepared(tmp_path_factory):
    """Two corpora split by prepare with one tokenizer (c: 60 documents, d: 40), and an unsplit c."""
    d = tmp_path_factory.mktemp('prepared')
    _prepare(f'--input={_jsonl(d / "c.jsonl", _docs("c", 60))}', f'--output={d}/c', '--train_tokenizer=400',
             '--val_fraction=0.25')
    _prepare(f'--input={_jsonl(d / "d.jsonl", _docs("d", 40))}', f'--output={d}/d', f'--tokenizer={d}/c.tokenizer.json',
             '--val_fraction=0.25', '--seed=1')
    _prepare(f'--input={d / "c.jsonl"}', f'--output={d}/whole', f'--tokenizer={d}/c.tokenizer.json', '--shuffle')
    return d


def test_val_path_is_checked_before_training(prepared, tmp_path):
    validation.validate_run(_config(path=f'{prepared}/c_train.bin', val_path=f'{prepared}/c_val.bin'))
    with pytest.raises(ConfigError, match='does not exist') as e:
        validation.validate_run(_config(path=f'{prepared}/c_train.bin', val_path=f'{tmp_path}/missing.bin'))
    assert e.value.field == 'data.val_path'
    vocab = json.load(open(prepared / 'c_val.json'))['vocab_size']
    other = token_files.write_token_file(tmp_path / 'other.bin', np.arange(500) % 300, vocab_size=300)
    with pytest.raises(ConfigError, match=f'vocab_size {vocab} but .*other.bin has 300') as e:
        validation.validate_run(_config(path=f'{prepared}/c_train.bin', val_path=f'1:{prepared}/d_val.bin,1:{other}'))
    assert e.value.field == 'data.val_path' and len(str(e.value).splitlines()) == 1


def test_val_path_errors_through_main_are_one_line_and_exit_2(prepared, tmp_path):
    done = subprocess.run([sys.executable, '-m', 'jaxfrontier.main', *processes.TINY, f'--workdir={tmp_path}/w',
                           '--config.data.kind=tokens', f'--config.data.path={prepared}/c_train.bin',
                           '--config.model.vocab_size=0', f'--config.data.val_path={tmp_path}/nothing.bin'],
                          cwd=REPO, env=processes.subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr[-2000:]
    assert 'config.data.val_path' in done.stderr and 'does not exist' in done.stderr
    assert not os.path.exists(tmp_path / 'w' / 'metrics.jsonl')


def test_tail_split_warning(prepared, tmp_path):
    warning = loader.tail_split_warning(_config(path=f'{prepared}/c_train.bin').data)
    assert 'documents in corpus order' in warning and f'data.val_path={prepared}/c_val.bin' in warning
    assert loader.tail_split_warning(_config(path=f'{prepared}/whole.bin').data) is None  # shuffled
    held_out = _config(path=f'{prepared}/c_train.bin', val_path=f'{prepared}/c_val.bin')
    assert loader.tail_split_warning(held_out.data) is None
    old = token_files.write_token_file(tmp_path / 'old.bin', np.arange(500) % 300, vocab_size=300)
    warning = loader.tail_split_warning(_config(blend=f'1:{prepared}/whole.bin,1:{old}').data)
    assert 'old.bin (documents of unknown order)' in warning and 'whole.bin' not in warning
    assert 'prepare ... --val_fraction' in warning and 'data.val_path' in warning


def test_blend_evaluates_each_file_and_weighs_the_overall_loss(prepared):
    """A data.val_path blend: each file's loss on its own full batches, overall weighted 3:1."""
    c = _config(path=f'{prepared}/c_train.bin', val_path=f'3:{prepared}/c_val.bin,1:{prepared}/d_val.bin')
    c.train.update(global_batch=8, eval_batches=2)
    validation.validate_run(c)
    _, val = loader.make_datasets(c.data, '', loader.BatchSpec.of(c))
    assert val.names == ('c_val', 'd_val') and val.weights == (3.0, 1.0)
    sharding = NamedSharding(jax.make_mesh((8,), ('data',), axis_types=(jax.sharding.AxisType.Auto,)), P('data'))
    result = evaluation.evaluate(lambda params, batch: batch.astype(np.float32).mean(), None, val, sharding,
                                 eval_batches=c.train.eval_batches, global_batch=c.train.global_batch, packing=None)
    expected = {name: np.mean([s.read_rows(i, np.arange(8), 8).mean() for i in range(2)])
                for name, s in zip(val.names, val.sources)}
    np.testing.assert_allclose(float(result['eval/loss/c_val']), expected['c_val'], rtol=1e-6)
    np.testing.assert_allclose(float(result['eval/loss/d_val']), expected['d_val'], rtol=1e-6)
    np.testing.assert_allclose(float(result['eval/loss']), 0.75 * expected['c_val'] + 0.25 * expected['d_val'],
                               rtol=1e-6)
    assert evaluation.eval_line(5, {k: float(v) for k, v in result.items()}).startswith('eval: step 5: loss ')


# --------------------------------------------------------------------------- training through main


def _main(*args):
    done = processes.run_main('--config.train.steps=2', '--config.data.kind=tokens', '--config.model.vocab_size=0',
                              *args)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


@pytest.mark.slow  # two short trainings and one --mode=eval of tiny models: ~1.5 min
def test_training_reports_the_held_out_files_loss(prepared, tmp_path):
    """data.val_path's loss equals --mode=eval of that file at the same checkpoint; a blend reports each file."""
    # A held-out file of exactly eval_batches * global_batch windows: the eval reads every window once.
    vocab = json.load(open(prepared / 'c_val.json'))['vocab_size']
    val = token_files.open_token_file(prepared / 'c_val.bin', vocab)
    assert val.num_tokens > BATCH * SEQ_LEN + 1
    (tmp_path / 'c.tokenizer.json').write_bytes((prepared / 'c.tokenizer.json').read_bytes())
    exact = token_files.write_token_file(tmp_path / 'exact.bin', np.asarray(val.tokens[:BATCH * SEQ_LEN + 1]), vocab,
                                         metadata={k: val.header[k] for k in ('eot_id', 'tokenizer')})
    run = _main(f'--workdir={tmp_path}/w', f'--config.data.path={prepared}/c_train.bin',
                f'--config.data.val_path={exact}')
    assert 'the validation split is the last' not in run.stderr
    final = processes.read_metrics(f'{tmp_path}/w')[-1]
    assert final['step'] == 2 and not any(k.startswith('eval/loss/') for k in final)
    assert f'eval: step 2: loss {final["eval/loss"]:.4f}' in run.stderr
    scored = _main(f'--workdir={tmp_path}/w', '--mode=eval')  # no --eval_path: the run's data.val_path
    result = json.loads(scored.stdout.strip().splitlines()[-1])
    assert result['path'] == exact and result['step'] == 2 and result['windows'] == BATCH
    np.testing.assert_allclose(final['eval/loss'], result['loss'], rtol=1e-5)

    # A training blend evaluates each file's tail split; its files are in corpus order: warned once.
    blend = _main(f'--workdir={tmp_path}/b', f'--config.data.blend=3:{prepared}/c_train.bin,1:{prepared}/d_train.bin')
    assert blend.stderr.count('the validation split is the last 0.02 of') == 1
    assert f'data.val_path={prepared}/c_val.bin' in blend.stderr
    final = processes.read_metrics(f'{tmp_path}/b')[-1]
    parts = final['eval/loss/c_train'], final['eval/loss/d_train']
    np.testing.assert_allclose(final['eval/loss'], 0.75 * parts[0] + 0.25 * parts[1], rtol=1e-6)
    assert (f'eval: step 2: loss {final["eval/loss"]:.4f} (c_train {parts[0]:.4f}, d_train {parts[1]:.4f})'
            in blend.stderr)
