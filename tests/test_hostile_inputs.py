"""Careless and hostile inputs of issue 28's weak cases: one line (exit 2), nothing run, nothing written.

- calibrate ran the Python file a results record named (`config_file`) beside the results, in the
  working directory or by absolute path;
- damaged Hugging Face directories through init_params_from gave tracebacks; one without weights
  said "no committed checkpoint ... train first";
- a non-UTF-8 --prompt gave a UnicodeEncodeError traceback; --eval_path errors named config.data.path;
- prepare --output=<existing directory> wrote beside it; a JSONL line that is an array was reported as
  a missing field; get_config() returning no ConfigDict gave an AttributeError; prepare --help and
  calibrate --help exited 1.

Issue 48: a token file's header named its tokenizer anywhere (`"tokenizer": "/abs/secret"`, `"../secret"`, a link
out of the directory) and an HF export copied that file as tokenizer.json; an LM or SFT run on a file of DPO pairs
trained on the chosen and the rejected answers alike (a file's kind must match train.objective); --mode=eval
scored the perplexity of a pairs file (now the same check: the kinds its run's objective reads).
"""

import json
import os
import types

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxfrontier.checkpoint.interop import hf_files as hf_dir
from jaxfrontier import config as config_lib
from jaxfrontier.checkpoint.interop import hf as hf_export
from jaxfrontier.data import corpus, dpo, loader, token_files
from jaxfrontier.data.corpus import FlagError
from jaxfrontier.errors import ConfigError, UserError
from jaxfrontier.inference import evaluate, evaluate_dpo
from jaxfrontier.inference import load as load_lib
from jaxfrontier.inference import text as text_lib
import processes
from test_hostile_finite import tiny_config, write_params


def run(module, *args, cwd=processes.REPO):
    return processes.run_main(*args, tiny=False, module=f'jaxfrontier.{module}', cwd=cwd, timeout=300)


# --------------------------------------------------------------------------- calibrate runs no code


@pytest.mark.parametrize('where', ['beside', 'cwd', 'absolute'])
def test_calibrate_runs_no_config_file_a_results_record_names(tmp_path, where):
    marker = tmp_path / 'ran'
    evil = tmp_path / ('sub' if where == 'cwd' else '') / 'evil.py'
    evil.parent.mkdir(exist_ok=True)
    evil.write_text(f'open({str(marker)!r}, "w").close()\ndef get_config(arg=None):\n    raise SystemExit(0)\n')
    results = tmp_path / 'results.jsonl'
    name = str(evil) if where == 'absolute' else 'evil.py'
    results.write_text(json.dumps({'source': 'published', 'name': 'p', 'machine': 'm', 'config_file': name,
                                   'layout': {}, 'step_time_s': 1.0}) + '\n')
    line = processes.error_line(run('calibrate', f'--results={results}', f'--out={tmp_path / "hw.json"}',
                          cwd=str(evil.parent) if where == 'cwd' else processes.REPO))
    assert "not one of the project's configs" in line and 'runs no code' in line
    assert not marker.exists()


@pytest.mark.parametrize('module', ['calibrate', 'prepare'])
def test_help_exits_0(module):
    proc = run(module, '--help')
    assert proc.returncode == 0 and '--' in proc.stdout


# --------------------------------------------------------------------------- damaged Hugging Face directories


def hf_directory(path, layers=1, d=32, heads=2, vocab=256, positions=32):
    config = {'model_type': 'gpt2', 'n_embd': d, 'n_layer': layers, 'n_head': heads, 'vocab_size': vocab,
              'n_positions': positions, 'activation_function': 'gelu_new', 'tie_word_embeddings': True}
    rng = np.random.RandomState(0)
    tensors = {f'transformer.{name}': (0.02 * rng.randn(*shape)).astype(np.float32)
               for name, shape in hf_dir.expected_shapes(config).items()}
    path.mkdir(parents=True, exist_ok=True)
    (path / 'config.json').write_text(json.dumps(config))
    save_file(tensors, str(path / 'model.safetensors'))
    return path


def damage(path, how):
    weights = path / 'model.safetensors'
    if how == 'truncated':
        data = weights.read_bytes()
        weights.write_bytes(data[:len(data) // 2])
    elif how == 'config_not_json':
        (path / 'config.json').write_text('{"model_type": "gpt2", n_embd')
    elif how == 'config_field_missing':
        config = json.loads((path / 'config.json').read_text())
        del config['n_layer']
        (path / 'config.json').write_text(json.dumps(config))
    elif how == 'wrong_shape':
        from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
        tensors = load_file(str(weights))
        tensors['transformer.h.0.mlp.c_fc.weight'] = np.zeros((32, 100), np.float32)
        save_file(tensors, str(weights))
    elif how == 'no_weights':
        weights.unlink()
        (path / 'pytorch_model.bin').write_bytes(b'x')
    return path


@pytest.mark.parametrize('how,named', [('truncated', 'truncated?'), ('config_not_json', 'is not JSON'),
                                       ('config_field_missing', 'n_layer = None'),
                                       ('wrong_shape', "'h.0.mlp.c_fc.weight' has shape [32, 100]"),
                                       ('no_weights', 'no model.safetensors (it has pytorch_model.bin')])
def test_damaged_hf_directory_is_one_line(tmp_path, how, named):
    source = damage(hf_directory(tmp_path / 'hf'), how)
    c = tiny_config()
    c.checkpoint.init_params_from = str(source)
    with pytest.raises(UserError) as e:
        load_lib.load(c, str(tmp_path / 'empty_workdir'))
    assert named in str(e.value) and '\n' not in str(e.value), str(e.value)


def test_intact_hf_directory_loads(tmp_path):
    c = tiny_config()
    c.checkpoint.init_params_from = str(hf_directory(tmp_path / 'hf'))
    loaded = load_lib.load(c, str(tmp_path / 'empty_workdir'))
    assert loaded.hf_dir == c.checkpoint.init_params_from


def test_cli_sample_from_a_truncated_hf_directory(tmp_path):
    source = damage(hf_directory(tmp_path / 'hf'), 'truncated')
    line = processes.error_line(run('main', *processes.TINY, '--config.model.num_heads=2', '--mode=sample', '--prompt=hi',
                          f'--config.checkpoint.init_params_from={source}', f'--workdir={tmp_path / "w"}'))
    assert 'model.safetensors is not a readable safetensors file' in line


# --------------------------------------------------------------------------- prompts, eval_path


def test_cli_prompt_that_is_not_utf8(tmp_path):
    proc = processes.run_main('--mode=sample', b'--prompt=caf\xe9', f'--workdir={tmp_path / "w"}', text=False)
    line = processes.error_line(proc)
    assert '--prompt=' in line and 'not UTF-8' in line


def test_prompt_file_that_is_not_utf8(tmp_path):
    from jaxfrontier.inference import sample  # pylint: disable=import-outside-toplevel
    path = tmp_path / 'prompts.txt'
    path.write_bytes(b'caf\xe9\n')
    with pytest.raises(UserError, match='is not UTF-8 text'):
        sample.read_prompts([], str(path))


@pytest.mark.slow  # loads a model before the path is read; the fast tier keeps the CLI's other one-line errors
def test_cli_eval_path_errors_name_the_flag(tmp_path):
    params = write_params(tmp_path / 'p.safetensors', tiny_config())
    line = processes.error_line(run('main', *processes.TINY, '--config.model.num_heads=2', '--mode=eval',
                          f'--eval_path={tmp_path / "missing.bin"}', f'--config.checkpoint.init_params_from={params}',
                          f'--workdir={tmp_path / "w"}'))
    assert line.startswith(f'error: --eval_path={tmp_path / "missing.bin"}:') and 'data.path' not in line, line


# --------------------------------------------------------------------------- prepare, config files


def test_cli_prepare_output_that_is_a_directory(tmp_path):
    text = tmp_path / 'a.txt'
    text.write_text('hello world\n')
    out = tmp_path / 'out'
    out.mkdir()
    line = processes.error_line(run('prepare', f'--input={text}', f'--output={out}', '--train_tokenizer=300',
                          '--progress=False'))
    assert 'is a directory' in line and f'--output={out}/NAME' in line
    assert sorted(os.listdir(tmp_path)) == ['a.txt', 'out'] and not os.listdir(out)


def test_jsonl_line_that_is_an_array(tmp_path):
    path = tmp_path / 'a.jsonl'
    path.write_text('{"text": "fine"}\n["not", "an", "object"]\n')
    with pytest.raises(FlagError, match='line 2 is a JSON list, not an object'):
        list(corpus.read_pieces([str(path)], 'text'))


@pytest.mark.parametrize('returned', ['{"a": 1}', 'None', '[1, 2]'])
def test_cli_get_config_returning_no_config_dict(tmp_path, returned):
    config = tmp_path / 'cfg.py'
    config.write_text(f'def get_config(arg=None):\n    return {returned}\n')
    line = processes.error_line(run('main', f'--config={config}', f'--workdir={tmp_path / "w"}'))
    assert 'get_config() returned' in line and 'not an ml_collections.ConfigDict' in line
    assert not (tmp_path / 'w').exists()


# --------------------------------------------------------------------------- files a token-file header names


def named_token_file(tmp_path, **header):
    """data/t.bin (+ t.tokenizer.json, + a secret outside data/ and a link to it) with `header` merged in."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / 'secret').write_text('{"private": "key"}')
    path = token_files.write_token_file(tmp_path / 'data' / 't.bin', np.arange(100) % 256, 256,
                                        metadata={'tokenizer': 't.tokenizer.json', 'eot_id': 0})
    (tmp_path / 'data' / 't.tokenizer.json').write_text('{}')
    os.symlink(tmp_path / 'secret', tmp_path / 'data' / 'out.json')
    os.symlink('t.tokenizer.json', tmp_path / 'data' / 'in.json')
    old = json.loads((tmp_path / 'data' / 't.json').read_text())
    (tmp_path / 'data' / 't.json').write_text(json.dumps({**old, **header}))
    return path


@pytest.mark.parametrize('field', sorted(token_files.NAMED_FILES))
@pytest.mark.parametrize('name,words', [('SECRET', 'not the name of a file beside the .bin'),
                                        ('../secret', 'not the name of a file beside the .bin'),
                                        ('out.json', "links outside the .bin's directory"),
                                        ('sub', 'is not a regular file'), ('\x1b[2J', 'not the name')])
def test_a_header_names_only_plain_files_beside_the_bin(tmp_path, field, name, words):
    name = str(tmp_path / 'secret') if name == 'SECRET' else name
    (tmp_path / 'data' / 'sub').mkdir(parents=True)
    path = named_token_file(tmp_path, **{field: name})
    with pytest.raises(ConfigError) as e:
        token_files.open_token_file(path, 256)
    assert f'"{field}"' in str(e.value) and words in str(e.value) and '\n' not in str(e.value), str(e.value)
    assert repr(name) in str(e.value) or repr(str(tmp_path / 'data' / name)) in str(e.value)


def test_an_hf_export_and_a_sample_never_read_a_tokenizer_outside_the_data(tmp_path):
    path = named_token_file(tmp_path, tokenizer=str(tmp_path / 'secret'))
    config = {'data': {'kind': 'tokens', 'path': path}, 'model': {'vocab_size': 256}}
    tokenizer, extra, warning = hf_export._tokenizer_of(config)  # pylint: disable=protected-access
    assert (tokenizer, extra) == (None, {}) and 'invalid header' in warning and 'tokenizer' in warning, warning  # none copied, said
    with pytest.raises(UserError, match='"tokenizer" is'):
        text_lib.token_file_codec(path, 256)
    inside = named_token_file(tmp_path / 'ok', tokenizer='in.json')  # a link beside the .bin is fine
    assert token_files.tokenizer_path(token_files.open_token_file(inside, 256)) == str(tmp_path / 'ok/data/in.json')


# --------------------------------------------------------------------------- a file's kind matches the objective


def kind_file(tmp_path, kind, name=None, pairs=64, row=33):
    """A token file of `kind` (token_files.KINDS): plain, sft (with a loss mask), dpo (prepare --dpo's header)."""
    tokens, mask = np.arange(pairs * 2 * row) % 256, np.tile([0, 1], pairs * row)
    metadata = {'row_length': row, 'dpo': {'pairs_in_file': pairs, 'seq_len': row - 1}} if kind == 'dpo' else {}
    return token_files.write_token_file(tmp_path / f'{name or kind}.bin', tokens, 256, metadata=metadata,
                                        mask=None if kind == 'plain' else mask)


def kind_config(objective, **data):
    c = config_lib.base_config()
    c.model.update(seq_len=32, vocab_size=256)
    c.train.update(objective=objective, global_batch=4, micro_batch=4)
    c.data.update(**{'kind': 'tokens', **data})
    return c


@pytest.mark.parametrize('objective,kind,field,words', [
    ('lm', 'dpo', 'path', 'the chosen and the rejected answers alike'),
    ('lm', 'dpo', 'val_path', 'the chosen and the rejected answers alike'),
    ('lm', 'dpo', 'blend', 'the chosen and the rejected answers alike'),
    ('dpo', 'sft', 'path', "does not read. Fix: set train.objective=lm"),
    ('dpo', 'plain', 'val_path', "does not read. Fix: set train.objective=lm"),
])
def test_a_file_whose_kind_the_objective_does_not_read_is_one_line(tmp_path, objective, kind, field, words):
    wrong = kind_file(tmp_path, kind, 'wrong')
    right = kind_file(tmp_path, 'dpo' if objective == 'dpo' else 'plain', 'right')
    data = {'path': wrong, 'val_path': ''} if field == 'path' else {'path': right, 'val_path': wrong} if (
        field == 'val_path') else {'path': '', 'blend': f'1:{right},1:{wrong}'}
    with pytest.raises(ConfigError) as e:
        loader.check_data(kind_config(objective, **data))
    message = str(e.value)
    assert e.value.field == f'data.{field}' and f'{wrong} holds' in message and f'(kind {kind})' in message
    assert words in message and '\n' not in message, message


def test_files_of_the_objectives_kinds_pass_and_the_sources_name_the_kind(tmp_path):
    for objective, kind in (('lm', 'plain'), ('lm', 'sft'), ('dpo', 'dpo')):
        loader.check_data(kind_config(objective, path=kind_file(tmp_path, kind)))
    for kind in ('builtin', 'synthetic'):
        with pytest.raises(ConfigError, match=r"data.kind='.*' holds a plain token stream \(kind plain\)"):
            loader.check_data(kind_config('dpo', kind=kind))
    c = kind_config('lm', path=kind_file(tmp_path, 'sft'), loss_mask='on')
    train, val = loader.make_datasets(c.data, str(tmp_path), loader.BatchSpec.of(c))
    assert '(kind sft)' in train.describe() and '(kind sft)' in val.describe()
    pairs = dpo.PairSource(np.zeros((4, 33), np.int32), 0, True, 'p.bin')
    assert pairs.describe() == '2 preference pairs of p.bin (kind dpo)'


def test_cli_lm_run_on_dpo_pairs_is_one_line(tmp_path):
    pairs = kind_file(tmp_path, 'dpo')
    line = processes.error_line(run('main', *processes.TINY, f'--config.data.path={pairs}',
                                    '--config.data.kind=tokens', f'--workdir={tmp_path / "w"}'))
    assert f'config.data.path = {pairs!r}' in line and '(kind dpo)' in line and 'train.objective=dpo' in line, line
    assert not (tmp_path / 'w').exists()


# --------------------------------------------------------------------------- --mode=eval reads the kinds its run reads

LM_ON_PAIRS = (": holds preference pairs of prepare --dpo, row 2i chosen and 2i + 1 rejected (kind dpo), which a run "
               "of train.objective='lm' does not score: its perplexity would score every row as text, the chosen "
               "and the rejected answers alike. Fix: pass --eval_path=FILE.bin of text or conversations (python -m "
               "jaxfrontier.prepare, --sft for conversations), or evaluate it with the --workdir of a "
               "train.objective=dpo run.")


eval_range, eval_pairs = evaluate._range, evaluate_dpo._pairs  # pylint: disable=protected-access


def loaded_run(objective, **data):
    """What evaluate takes of a loaded run (inference/load.Loaded): its config and saved config; no model."""
    c = kind_config(objective, **data)
    return types.SimpleNamespace(config=c, run_config=c.to_dict())


@pytest.mark.parametrize('source', ['eval_path', 'val_path', 'path'])
def test_eval_of_an_lm_run_on_dpo_pairs_is_one_line(tmp_path, source):
    pairs, plain = kind_file(tmp_path, 'dpo'), kind_file(tmp_path, 'plain')
    data = {'path': pairs if source == 'path' else plain, 'val_path': pairs if source == 'val_path' else ''}
    with pytest.raises(UserError) as e:
        eval_range(loaded_run('lm', **data), pairs if source == 'eval_path' else '', str(tmp_path))
    where = f'--eval_path={pairs}' if source == 'eval_path' else f"the run's data.{source} {pairs}"
    assert str(e.value) == f'{where}{LM_ON_PAIRS}'


@pytest.mark.parametrize('kind,source', [('sft', 'eval_path'), ('plain', 'val_path')])
def test_eval_of_a_dpo_run_on_other_files_is_one_line(tmp_path, kind, source):
    wrong, pairs = kind_file(tmp_path, kind), kind_file(tmp_path, 'dpo')
    loaded = loaded_run('dpo', path=pairs, val_path=wrong if source == 'val_path' else pairs)
    with pytest.raises(UserError) as e:
        eval_pairs(loaded, wrong if source == 'eval_path' else '')
    where = f'--eval_path={wrong}' if source == 'eval_path' else f"the run's data.val_path {wrong}"
    assert str(e.value) == (
        f"{where}: holds {token_files.KINDS[kind]} (kind {kind}), which a run of train.objective='dpo' does not "
        'score. Fix: pass --eval_path=FILE.bin of preference pairs (python -m jaxfrontier.prepare --dpo), or '
        'evaluate it with the --workdir of a train.objective=lm run.')


def test_eval_reads_the_kinds_its_run_reads(tmp_path):
    for kind in ('plain', 'sft'):
        path = kind_file(tmp_path, kind)
        assert eval_range(loaded_run('lm', path=path), path, str(tmp_path))[:3] == (path, 0, 64 * 2 * 33)
    pairs = kind_file(tmp_path, 'dpo')
    path, rows = eval_pairs(loaded_run('dpo', path=pairs, val_path=pairs), '')
    assert path == pairs and rows.shape == (128, 33)


@pytest.mark.slow  # loads a model before the path is read
def test_cli_eval_of_dpo_pairs_is_one_line(tmp_path):
    params, pairs = write_params(tmp_path / 'p.safetensors', tiny_config()), kind_file(tmp_path, 'dpo')
    proc = run('main', *processes.TINY, '--config.model.num_heads=2', '--mode=eval', f'--eval_path={pairs}',
               f'--config.checkpoint.init_params_from={params}', f'--workdir={tmp_path / "w"}')
    assert proc.returncode == 2 and processes.error_line(proc) == f'error: --eval_path={pairs}{LM_ON_PAIRS}'
