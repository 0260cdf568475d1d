"""prepare on hostile text (issue 28, failure 3): one long line of one repeated character.

`prepare --train_tokenizer` on a 1 MiB line of one character took over 4 minutes (30 MiB: over 10,
no output): BPE training is quadratic in the length of one word. data/long_words.py bounds the
words the trainer sees.
"""

import json
import subprocess
import sys

import numpy as np

from jaxfrontier.data import token_files as data_lib
from jaxfrontier.data import long_words
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
