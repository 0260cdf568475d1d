"""prepare on hostile text (issue 28, failure 3): one long line of one repeated character.

`prepare --train_tokenizer` on a 1 MiB line of one character took over 4 minutes (30 MiB: over 10,
no output): BPE training is quadratic in the length of one word. data/long_words.py bounds the
words the trainer sees.

Issue 48's weak answers, each now one line and exit 2: `--sft --dpo` together; `--dpo` of an empty file
(which suggested the default --overlong=truncate); --val_fraction of one document; a full disk while encoding
(a traceback, and a partial output must not look complete); a huge conversation rendered for minutes without a
word (now one line before it); and a tokenizer directory that asks to run its own code (`auto_map`).
"""

import errno
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxfrontier import prepare as prepare_main
from jaxfrontier.data import chat, documents, dpo, encode, sft
from jaxfrontier.data import token_files as data_lib
from jaxfrontier.data import long_words
from jaxfrontier.errors import FlagError
import chat_models
import processes


def test_bounded_cuts_only_long_runs():
    assert list(long_words.bounded(['short text', ''])) == ['short text', '']
    text = 'x ' + 'a' * 600 + ' y' + ' ' * 300 + 'z'
    pieces = list(long_words.bounded([text]))
    assert ''.join(pieces) == text
    assert max(len(p) for p in pieces) <= long_words.LIMIT + 2
    assert pieces.count('a' * 256) == 2


def test_cli_trains_a_tokenizer_on_one_long_line_in_seconds(tmp_path):
    """1 MiB of one character: was > 4 minutes; now the tokenizer trains and the file is right."""
    line = tmp_path / 'line.txt'
    line.write_text('a' * (1 << 20))
    out = tmp_path / 'tok' / 'line'
    proc = subprocess.run([sys.executable, '-m', 'jaxfrontier.prepare', f'--input={line}', f'--output={out}',
                           '--train_tokenizer=50257', '--progress=False'], cwd=processes.REPO,
                          env=processes.subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    header = json.loads((tmp_path / 'tok' / 'line.json').read_text())
    tokens = np.fromfile(tmp_path / 'tok' / 'line.bin', dtype=header['dtype'])
    assert tokens[-1] == header['eot_id'] and len(tokens) < (1 << 20) // 100  # merges of long runs learned
    assert data_lib.open_token_file(str(out) + '.bin', header['vocab_size']).header == header


# --------------------------------------------------------------------------- issue 48


def prepare_cli(*args, code=None):
    """`python -m jaxfrontier.prepare ARGS`, or `python -c CODE ARGS` (CODE patches, then runs prepare)."""
    if code is None:
        return processes.run_main(*args, '--progress=False', tiny=False, module='jaxfrontier.prepare')
    return subprocess.run([sys.executable, '-c', code, *args, '--progress=False'], cwd=processes.REPO,
                          env=processes.subprocess_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope='module')
def tokenizer_json(tmp_path_factory):
    """A tiny trained byte-level tokenizer.json (no chat template)."""
    path = tmp_path_factory.mktemp('tok') / 'tokenizer.json'
    path.write_text(encode.train_tokenizer(iter(['hello world, hello tokens'] * 3), 300)[1])
    return str(path)


@pytest.fixture(scope='module')
def chat_dir(tmp_path_factory):
    pytest.importorskip('transformers')
    return chat_models.save_tokenizer(tmp_path_factory.mktemp('chat') / 'chatml')


def test_cli_sft_and_dpo_together_is_one_line(tmp_path):
    line = processes.error_line(prepare_cli('--sft', '--dpo', f'--input={tmp_path}/a.jsonl', f'--output={tmp_path}/o'))
    assert '--dpo=True' in line and 'pass one of them' in line and not os.listdir(tmp_path)


def test_dpo_of_an_empty_file_is_one_line_that_does_not_suggest_the_default(tmp_path, chat_dir):
    (tmp_path / 'empty.jsonl').write_text('')
    with pytest.raises(FlagError) as e:
        dpo.prepare([str(tmp_path / 'empty.jsonl')], str(tmp_path / 'o' / 'x'), tokenizer_path=chat_dir, seq_len=15)
    assert 'no preference pair' in str(e.value) and 'overlong' not in str(e.value) and '\n' not in str(e.value)
    source = chat_models.write_jsonl(tmp_path / 'long.jsonl', [{'prompt': 'yes ' * 20, 'chosen': 'no', 'rejected': 'ok'}])
    with pytest.raises(FlagError, match='all 1 dropped .* Fix: raise --seq_len, or pass --overlong=truncate'):
        dpo.prepare([source], str(tmp_path / 'o' / 'x'), tokenizer_path=chat_dir, seq_len=15, overlong='drop')
    one = chat_models.write_jsonl(tmp_path / 'one.jsonl', chat_models.preference_pairs(1))
    with pytest.raises(FlagError, match='one pair cannot be split'):
        dpo.prepare([one], str(tmp_path / 'o' / 'x'), tokenizer_path=chat_dir, seq_len=15, val_fraction=0.5)
    assert not os.path.exists(tmp_path / 'o')


@pytest.mark.parametrize('val', [documents.Split(val_fraction=0.5), documents.Split(val_fraction=0.01),
                                 documents.Split(val_documents=1)])
def test_val_split_of_one_document_is_one_line(tmp_path, tokenizer_json, val):
    (tmp_path / 'a.txt').write_text('hello world\n')
    with pytest.raises(FlagError) as e:
        encode.prepare([str(tmp_path / 'a.txt')], str(tmp_path / 'o' / 'x'), tokenizer_path=tokenizer_json, split=val)
    assert 'one document cannot be split' in str(e.value) and '\n' not in str(e.value), str(e.value)
    assert os.listdir(tmp_path / 'o') == []


FULL_DISK = """import errno, sys
from jaxfrontier.data import encode
def full(batches, bin_file, dtype, progress):
    bin_file.write(b'partial')
    raise OSError(errno.ENOSPC, 'No space left on device', bin_file.name)
encode._write_stream = full
from jaxfrontier import prepare
prepare.run()
"""


def test_cli_full_disk_while_encoding_is_one_line_and_the_old_output_stays(tmp_path, tokenizer_json):
    (tmp_path / 'a.txt').write_text('hello world\n')
    out = tmp_path / 'o' / 'x'
    encode.prepare([str(tmp_path / 'a.txt')], str(out), tokenizer_path=tokenizer_json)
    before = {name: (tmp_path / 'o' / name).read_bytes() for name in os.listdir(tmp_path / 'o')}
    line = processes.error_line(prepare_cli(f'--input={tmp_path / "a.txt"}', f'--output={out}',
                                            f'--tokenizer={tokenizer_json}', code=FULL_DISK))
    assert line.startswith('error: no space left on the device holding') and 'nothing was published' in line
    assert {name: (tmp_path / 'o' / name).read_bytes() for name in os.listdir(tmp_path / 'o')} == before


def test_full_disk_while_writing_dpo_pairs_leaves_no_header(tmp_path, chat_dir, monkeypatch):
    source = chat_models.write_jsonl(tmp_path / 'p.jsonl', chat_models.preference_pairs(10))
    real, calls = data_lib.write_token_file, []

    def second_fails(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, 'No space left on device', args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(data_lib, 'write_token_file', second_fails)
    with pytest.raises(OSError) as e:
        dpo.prepare([source], str(tmp_path / 'o' / 'x'), tokenizer_path=chat_dir, seq_len=15, val_fraction=0.2)
    assert not [n for n in os.listdir(tmp_path / 'o') if n.endswith('.json') and 'tokenizer' not in n]
    assert not [n for n in os.listdir(tmp_path / 'o') if '.tmp' in n]
    message = str(prepare_main.disk_full_error(e.value, str(tmp_path / 'o' / 'x')))
    assert message.startswith(f'no space left on the device holding {calls[1]} (') and '\n' not in message


def test_a_huge_conversation_is_announced_before_it_renders(tmp_path, chat_dir, monkeypatch):
    monkeypatch.setattr(sft, 'LARGE_RECORD_BYTES', 200)
    records = chat_models.conversations(3)
    records[1]['messages'][0]['content'] = 'what follows ' + 'one ' * 60
    source = chat_models.write_jsonl(tmp_path / 'c.jsonl', records)
    lines = []
    sft.prepare([source], str(tmp_path / 'o' / 'x'), tokenizer_path=chat_dir, notify=lines.append,
                options=sft.Options(max_tokens=40))
    assert len(lines) == 1 and f'{source} line 2 is a conversation of' in lines[0], lines
    assert '--max_tokens=40 cuts it only once rendered' in lines[0]


@pytest.mark.parametrize('file,auto_map', [
    ('tokenizer_config.json', {'AutoTokenizer': ['evil.EvilTokenizer', None]}),
    ('tokenizer_config.json', ['evil.EvilTokenizer', None]),  # the older list form
    ('config.json', {'AutoConfig': 'evil.EvilConfig', 'AutoModelForCausalLM': 'evil.Model'}),
])
def test_a_tokenizer_directory_that_asks_to_run_code_is_one_line(tmp_path, chat_dir, file, auto_map):
    directory = tmp_path / 'tok'
    directory.mkdir()
    for name in ('tokenizer.json', 'tokenizer_config.json'):
        (directory / name).write_bytes(open(os.path.join(chat_dir, name), 'rb').read())
    (directory / 'evil.py').write_text(f'open({str(tmp_path / "ran")!r}, "w").close()\n')
    settings = json.loads((directory / file).read_text()) if (directory / file).exists() else {'model_type': 'llama'}
    (directory / file).write_text(json.dumps({**settings, 'auto_map': auto_map}))
    with pytest.raises(FlagError) as e:
        chat.load_tokenizer(str(directory))
    message = str(e.value)
    assert f'{directory / file} asks to run code of its own' in message and '\n' not in message, message
    assert not (tmp_path / 'ran').exists()


def test_cli_sft_with_a_code_running_tokenizer_is_one_line(tmp_path, chat_dir):
    directory = tmp_path / 'tok'
    directory.mkdir()
    (directory / 'tokenizer_config.json').write_text(json.dumps({'auto_map': {'AutoTokenizer': ['x.T', None]}}))
    source = chat_models.write_jsonl(tmp_path / 'c.jsonl', chat_models.conversations(2))
    line = processes.error_line(prepare_cli('--sft', f'--input={source}', f'--tokenizer={directory}',
                                            f'--output={tmp_path}/o/x'))
    assert 'tokenizer_config.json asks to run code of its own' in line and not (tmp_path / 'o').exists()


def test_tokenizers_load_without_remote_code(chat_dir, monkeypatch):
    import transformers  # pylint: disable=import-outside-toplevel
    seen = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, 'from_pretrained',
                        lambda *a, **k: seen.append(k) or real(*a, **k))
    assert chat.load_tokenizer(chat_dir).chat_template == chat_models.CHATML
    assert seen and all(k.get('trust_remote_code') is False for k in seen)
