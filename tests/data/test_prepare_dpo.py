"""`python -m jaxfrontier.prepare --dpo` (data/dpo.py): preference pairs -> rows 2i chosen, 2i + 1 rejected,
right-padded to seq_len + 1, the mask counting only the answers; over-long pairs cut or dropped and
counted; bad pairs one line, exit 2, nothing written. The tokenizer is tests/chat_models.py's (one
token per word, ChatML), so the expected rows are written by hand."""

import json
import os

import numpy as np
import pytest

pytest.importorskip('transformers')

from jaxfrontier.data import dpo, token_files  # noqa: E402
from jaxfrontier.data import loss_mask  # noqa: E402
import chat_models  # noqa: E402
import processes  # noqa: E402

V = chat_models.VOCAB
EOT, START, END = V['<|endoftext|>'], V['<|im_start|>'], V['<|im_end|>']


@pytest.fixture(scope='module')
def tokenizer_dir(tmp_path_factory):
    return chat_models.save_tokenizer(tmp_path_factory.mktemp('tok') / 'chatml')


def side(prompt, answer):
    """(tokens, mask) of prompt + answer under ChatML, by hand."""
    user = [START, V['user'], *(V[w] for w in prompt.split()), END]
    gen = [START, V['assistant']]
    said = [V[w] for w in answer.split()] + [END]
    return user + gen + said, [0] * (len(user) + len(gen)) + [1] * len(said)


def test_pairs_become_aligned_rows_with_the_answers_counted(tmp_path, tokenizer_dir):
    pairs = [{'prompt': 'what follows one', 'chosen': 'two', 'rejected': 'five six'},
             {'prompt': [{'role': 'user', 'content': 'what follows two'}],
              'chosen': {'role': 'assistant', 'content': 'three'}, 'rejected': [{'role': 'assistant', 'content': 'no'}]}]
    source = chat_models.write_jsonl(tmp_path / 'p.jsonl', pairs)
    headers = dpo.prepare([source], str(tmp_path / 'o' / 'pairs'), tokenizer_path=tokenizer_dir, seq_len=15)
    assert headers['']['row_length'] == 16 and headers['']['dpo']['pairs']['written'] == 2
    rows = dpo.read_rows(str(tmp_path / 'o' / 'pairs.bin'), 64)
    assert rows.shape == (4, 16)
    for r, (prompt, answer) in enumerate([('what follows one', 'two'), ('what follows one', 'five six'),
                                          ('what follows two', 'three'), ('what follows two', 'no')]):
        tokens, mask = side(prompt, answer)
        expected = loss_mask.mark(np.array(tokens + [EOT] * (16 - len(tokens))), np.array(mask + [0] * (16 - len(mask))))
        np.testing.assert_array_equal(rows[r], expected)


def test_over_long_pairs_are_cut_prompt_first_or_dropped_and_counted(tmp_path, tokenizer_dir):
    pairs = [{'prompt': 'what follows one two three four', 'chosen': 'two', 'rejected': 'five'},  # 13 tokens a side
             {'prompt': 'yes', 'chosen': 'one two three four five six seven eight', 'rejected': 'no'}]  # 15
    source = chat_models.write_jsonl(tmp_path / 'p.jsonl', pairs)
    headers = dpo.prepare([source], str(tmp_path / 'cut'), tokenizer_path=tokenizer_dir, seq_len=9)
    assert headers['']['dpo']['pairs'] == {'written': 2, 'truncated': 2, 'dropped_overlong': 0}
    rows = dpo.read_rows(str(tmp_path / 'cut.bin'), 64)
    tokens, mask = side('what follows one two three four', 'two')
    assert len(tokens) == 13  # 3 over the row: the prompt's first 3 tokens go
    np.testing.assert_array_equal(rows[0], loss_mask.mark(np.array(tokens[3:]), np.array(mask[3:])))
    tokens, mask = side('yes', 'one two three four five six seven eight')
    # 15 tokens: the prompt goes but its last token (the answer's context), and the whole answer then fits
    np.testing.assert_array_equal(rows[2], loss_mask.mark(np.array(tokens[5:]), np.array(mask[5:])))
    tokens, mask = side('yes', 'no')
    np.testing.assert_array_equal(rows[3], loss_mask.mark(np.array(tokens + [EOT] * 2), np.array(mask + [0] * 2)))
    headers = dpo.prepare([source], str(tmp_path / 'drop'), tokenizer_path=tokenizer_dir, seq_len=12,
                          overlong='drop')
    assert headers['']['dpo']['pairs'] == {'written': 1, 'truncated': 0, 'dropped_overlong': 1}


def test_held_out_pairs_keep_both_rows(tmp_path, tokenizer_dir):
    source = chat_models.write_jsonl(tmp_path / 'p.jsonl', chat_models.preference_pairs(20))
    headers = dpo.prepare([source], str(tmp_path / 'h'), tokenizer_path=tokenizer_dir, seq_len=15,
                          val_fraction=0.2)
    assert headers['train']['dpo']['pairs_in_file'] == 16 and headers['val']['dpo']['pairs_in_file'] == 4
    val = dpo.read_rows(str(tmp_path / 'h_val.bin'), 64)
    prompts = loss_mask.token_ids(val)[:, :6]
    assert val.shape == (8, 16) and (prompts[0::2] == prompts[1::2]).all()  # each pair's rows share the prompt
    assert json.load(open(tmp_path / 'h_val.json'))['sft']['chat_template'] == chat_models.CHATML


BAD = {
    'identical pair': ([{'prompt': 'yes', 'chosen': 'no', 'rejected': 'no'}], ['line 1', 'identical']),
    'missing field': ([{'prompt': 'yes', 'chosen': 'no'}], ['line 1', "'rejected'"]),
    'answer not text': ([{'prompt': 'yes', 'chosen': 3, 'rejected': 'no'}], ['"chosen" is a JSON int']),
}


@pytest.mark.parametrize('name', [n if n == 'identical pair' else pytest.param(n, marks=pytest.mark.slow) for n in BAD])
def test_bad_pairs_are_one_line_exit_2_nothing_written(tmp_path, tokenizer_dir, name):
    records, words = BAD[name]
    good = chat_models.preference_pairs(2)
    source = chat_models.write_jsonl(tmp_path / 'bad.jsonl', records + good)
    proc = processes.run_main('--dpo', f'--input={source}', f'--tokenizer={tokenizer_dir}',
                              f'--output={tmp_path}/out/x', '--seq_len=15', '--progress=false', tiny=False,
                              module='jaxfrontier.prepare')
    line = processes.error_line(proc)
    for word in words:
        assert word in line, (word, line)
    assert not os.path.exists(tmp_path / 'out')
