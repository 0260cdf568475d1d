"""`python -m jaxfrontier.prepare --sft`: conversation JSONL -> tokens and a loss mask (data/sft.py, data/chat.py).

The tokenizer is made here, no network: a WordLevel vocabulary with a whitespace pre-tokenizer
(one token per word, newlines dropped) saved as a Hugging Face directory whose
tokenizer_config.json carries a ChatML-style Jinja template. So the expected tokens and mask of
a conversation are computed by hand: each message is [<|im_start|>, role, words..., <|im_end|>],
the generation prompt [<|im_start|>, assistant], and a learned assistant turn counts its words
and its <|im_end|>.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from jaxfrontier import prepare as prepare_main
from jaxfrontier.data import chat, corpus, documents, sft, token_files
from jaxfrontier.errors import FlagError, UserError

pytest.importorskip('transformers')
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPECIAL = ['<unk>', '<|endoftext|>', '<|im_start|>', '<|im_end|>']
WORDS = ('system user assistant tool be nice hello world how are you fine thanks hi there ok bye good day to '
         'what is it one two three four five six seven eight nine ten').split()
VOCAB = {t: i for i, t in enumerate(SPECIAL + WORDS)}
UNK, EOT, START, END = range(4)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Rewrites history: earlier assistant turns are elided (as reasoning templates drop old thoughts).
REWRITING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and not loop.last %}"
             "ok{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
RAISING = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"


def make_tokenizer(directory, template=CHATML):
    """A Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json with `template`)."""
    tokenizer = Tokenizer(models.WordLevel(VOCAB, unk_token='<unk>'))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(s, special=True) for s in SPECIAL[1:]])
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, 'tokenizer.json'))
    config = {'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': '<|im_end|>', 'unk_token': '<unk>'}
    if template is not None:
        config['chat_template'] = template
    with open(os.path.join(directory, 'tokenizer_config.json'), 'w') as f:
        json.dump(config, f)
    return str(directory)


def conversation(*turns):
    """[(role, 'words ...'), ...] -> messages."""
    return [{'role': role, 'content': text} for role, text in turns]


def expected(messages, learned, loss_on='assistant'):
    """(tokens, mask) of a conversation by the rule in the module docstring, end-of-text included."""
    tokens, mask = [], []
    for i, m in enumerate(messages):
        words = [VOCAB[w] for w in m['content'].split()]
        tokens += [START, VOCAB[m['role']], *words, END]
        counts = loss_on == 'all' or i in learned
        mask += [int(loss_on == 'all')] * 2 + [int(counts)] * (len(words) + 1)
    return tokens + [EOT], mask + [int(loss_on == 'all')]


CONVERSATIONS = [
    conversation(('system', 'be nice'), ('user', 'hello world'), ('assistant', 'hi there'), ('user', 'how are you'),
                 ('assistant', 'fine thanks')),
    conversation(('user', 'what is it'), ('assistant', 'one two three'), ('tool', 'four'), ('assistant', 'five six')),
    conversation(('user', 'good day'), ('assistant', 'bye')),
]


def write_jsonl(path, records):
    with open(path, 'w') as f:
        f.writelines(json.dumps(r) + '\n' for r in records)
    return str(path)


def read_output(bin_path):
    header = json.load(open(token_files.token_paths(bin_path)[1]))
    opened = token_files.open_token_file(bin_path, header['vocab_size'])
    return header, np.asarray(opened.tokens), np.asarray(opened.mask)


def split_documents(tokens, mask):
    cuts = np.flatnonzero(tokens == EOT) + 1
    return [(t.tolist(), m.tolist()) for t, m in zip(np.split(tokens, cuts[:-1]), np.split(mask, cuts[:-1]))]


@pytest.fixture(scope='module')
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp('tok') / 'chatml')


@pytest.mark.parametrize('loss_on', ['assistant', 'last_assistant', 'all'])
def test_the_mask_is_the_assistant_turns(tmp_path, tokenizer_dir, loss_on):
    source = write_jsonl(tmp_path / 'c.jsonl', [{'messages': m} for m in CONVERSATIONS])
    result = sft.prepare([source], str(tmp_path / 'o' / 'c'), tokenizer_path=tokenizer_dir,
                         options=sft.Options(loss_on))
    header, tokens, mask = read_output(result.bin_paths[''])
    want = []
    for messages in CONVERSATIONS:
        assistant = [i for i, m in enumerate(messages) if m['role'] == 'assistant']
        want.append(expected(messages, assistant[-1:] if loss_on == 'last_assistant' else assistant, loss_on))
    assert split_documents(tokens, mask) == want
    assert header['loss_mask'] == 'c.mask.bin' and header['counted_tokens'] == int(mask.sum())
    assert header['sft']['loss_on'] == loss_on and header['sft']['rendering'] == 'chat_template'
    assert header['sft']['chat_template'] == CHATML and header['eot_id'] == EOT
    assert sorted(os.listdir(tmp_path / 'o')) == ['c.bin', 'c.json', 'c.mask.bin', 'c.tokenizer.json']


def test_prompt_completion_pairs_with_and_without_a_template(tmp_path, tokenizer_dir):
    records = [{'prompt': 'hello world', 'completion': 'hi there'},
               {'prompt': [{'role': 'system', 'content': 'be nice'}, {'role': 'user', 'content': 'what is it'},
                           {'role': 'assistant', 'content': 'ten'}, {'role': 'user', 'content': 'how are you'}],
                'completion': [{'role': 'assistant', 'content': 'fine'}]}]  # conversational: only the completion
    source = write_jsonl(tmp_path / 'p.jsonl', records)
    result = sft.prepare([source], str(tmp_path / 't'), tokenizer_path=tokenizer_dir)
    first = conversation(('user', 'hello world'), ('assistant', 'hi there'))
    second = records[1]['prompt'] + records[1]['completion']
    assert split_documents(*read_output(result.bin_paths[''])[1:]) == [expected(first, [1]), expected(second, [4])]
    plain_dir = make_tokenizer(tmp_path / 'plain', template=None)  # no template: plain concatenation
    result = sft.prepare([write_jsonl(tmp_path / 'q.jsonl', records[:1])], str(tmp_path / 'n'),
                         tokenizer_path=plain_dir)
    header, tokens, mask = read_output(result.bin_paths[''])
    hello, world, hi, there = (VOCAB[w] for w in 'hello world hi there'.split())
    assert tokens.tolist() == [hello, world, hi, there, EOT] and mask.tolist() == [0, 0, 1, 1, 0]
    assert header['sft']['rendering'] == 'concatenation' and header['sft']['chat_template'] is None


def test_special_token_text_in_a_message_is_text(tmp_path, tokenizer_dir):
    """A user who writes '<|im_end|>' does not end the turn (transformers' sanitize_control_tokens)."""
    renderer = chat.Renderer(chat.load_tokenizer(tokenizer_dir), tokenizer_dir)
    if not renderer.sanitize:
        pytest.skip('this transformers encodes special-token text in messages as the special token')
    messages = conversation(('user', 'hello <|im_end|> <|im_start|>assistant'), ('assistant', 'hi'))
    record = corpus.Record({'messages': messages}, 'x.jsonl', 1, 0)
    tokens, mask = renderer.render(record, chat.parse(record, 'assistant'), 'assistant')
    assert tokens.count(START) == 2 and tokens.count(END) == 2 and sum(mask) == 2  # 'hi' and its <|im_end|>


def test_the_held_out_split_keeps_each_mask_with_its_conversation(tmp_path, tokenizer_dir):
    rng = np.random.default_rng(0)
    records = []
    for i in range(30):  # distinct conversations, so each document says which it was
        words = ' '.join(rng.choice(WORDS[4:], size=i % 5 + 1))
        records.append({'messages': conversation(('user', words), ('assistant', WORDS[4 + i % 27]),
                                                  ('user', 'ok'), ('assistant', words))})
    source = write_jsonl(tmp_path / 's.jsonl', records)
    result = sft.prepare([source], str(tmp_path / 's'), tokenizer_path=tokenizer_dir,
                         split=documents.Split(val_fraction=0.2, seed=3, shuffle=True))
    by_tokens = {tuple(t): m for t, m in (expected(r['messages'], [1, 3]) for r in records)}
    seen = 0
    for part in ('train', 'val'):
        header, tokens, mask = read_output(result.bin_paths[part])
        docs = split_documents(tokens, mask)
        assert all(by_tokens[tuple(t)] == m for t, m in docs)
        assert header['num_documents'] == len(docs) and header['counted_tokens'] == int(mask.sum())
        assert header['loss_mask'] == f's_{part}.mask.bin'
        seen += len(docs)
    assert seen == 30 and len(split_documents(*read_output(result.bin_paths['val'])[1:])) == 6


def test_overlong_conversations_are_counted_truncated_or_dropped(tmp_path, tokenizer_dir):
    long = conversation(('user', 'one two three four five six'), ('assistant', 'seven eight nine ten'))  # 17 tokens
    no_room = conversation(('user', ' '.join(['ok'] * 12)), ('assistant', 'bye'))  # 20: the cut leaves no answer
    short = conversation(('user', 'hi'), ('assistant', 'ok'))  # 9 tokens
    source = write_jsonl(tmp_path / 'l.jsonl', [{'messages': m} for m in (long, no_room, short)])
    result = sft.prepare([source], str(tmp_path / 'cut'), tokenizer_path=tokenizer_dir,
                         options=sft.Options(max_tokens=14))
    header, tokens, mask = read_output(result.bin_paths[''])
    cut_tokens, cut_mask = expected(long, [1])  # its first 13 tokens (the answer's 'seven eight'), then end-of-text
    assert split_documents(tokens, mask) == [(cut_tokens[:13] + [EOT], cut_mask[:13] + [0]), expected(short, [1])]
    assert sum(cut_mask[:13]) == 2
    assert header['sft']['conversations'] == {'written': 2, 'truncated': 2, 'cut_tokens': 3 + 6, 'dropped_overlong': 0,
                                              'dropped_empty': 1, 'counted_tokens': int(mask.sum()), 'eot_inside': 0}
    result = sft.prepare([source], str(tmp_path / 'drop'), tokenizer_path=tokenizer_dir,
                         options=sft.Options(max_tokens=14, overlong='drop'))
    header, tokens, mask = read_output(result.bin_paths[''])
    assert split_documents(tokens, mask) == [expected(short, [1])]
    assert header['sft']['conversations']['dropped_overlong'] == 2 and header['sft']['conversations']['truncated'] == 0


def test_an_end_of_text_inside_conversations_is_counted(tmp_path):
    """A template that writes the end-of-text token inside a conversation (as Mistral's writes </s> after each
    answer): packing would cut the conversation there, so it is counted and the log line says how to avoid it."""
    template = CHATML.replace("{{ m['content'] }}", "{{ m['content'] }}{% if m['role'] == 'assistant' %}"
                              "<|endoftext|>{% endif %}")
    tokenizer = make_tokenizer(tmp_path / 'eos', template)
    source = write_jsonl(tmp_path / 'c.jsonl', [{'messages': m} for m in CONVERSATIONS])
    result = sft.prepare([source], str(tmp_path / 'a'), tokenizer_path=tokenizer)
    assert result.headers['']['sft']['conversations']['eot_inside'] == 3
    assert 'hold the end-of-text token' in prepare_main.sft_line(result.headers['']['sft'], 1, 1, '<|endoftext|>')
    result = sft.prepare([source], str(tmp_path / 'b'), tokenizer_path=tokenizer, eot_token='<unk>')
    assert result.headers['']['sft']['conversations']['eot_inside'] == 0 and result.headers['']['eot_id'] == UNK


def test_text_written_over_conversations_leaves_no_stale_mask(tmp_path, tokenizer_dir):
    from jaxfrontier.data import encode  # pylint: disable=import-outside-toplevel
    source = write_jsonl(tmp_path / 'c.jsonl', [{'messages': m} for m in CONVERSATIONS])
    sft.prepare([source], str(tmp_path / 'o' / 'c'), tokenizer_path=tokenizer_dir)
    text = write_jsonl(tmp_path / 't.jsonl', [{'text': 'hello world'}])
    encode.prepare([text], str(tmp_path / 'o' / 'c'), tokenizer_path=os.path.join(tokenizer_dir, 'tokenizer.json'))
    assert sorted(os.listdir(tmp_path / 'o')) == ['c.bin', 'c.json', 'c.tokenizer.json']
    header = json.load(open(tmp_path / 'o' / 'c.json'))
    assert 'loss_mask' not in header and token_files.open_token_file(tmp_path / 'o' / 'c.bin', 40).mask is None


def _prepare(*args):
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([REPO] + [p for p in sys.path if p.endswith('site-packages')])}
    return subprocess.run([sys.executable, '-m', 'jaxfrontier.prepare', '--progress=false', *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_command_line_reports_what_it_did(tmp_path, tokenizer_dir):
    long = conversation(('user', 'one two three four five six'), ('assistant', 'seven eight nine ten'))
    source = write_jsonl(tmp_path / 'c.jsonl', [{'messages': m} for m in CONVERSATIONS + [long]])
    done = _prepare('--sft', f'--input={source}', f'--tokenizer={tokenizer_dir}', f'--output={tmp_path}/o/c',
                    '--max_tokens=16', '--val_documents=1')
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith('sft: 4 conversations rendered with the chat template of') and '3 truncated' in line
    assert 'loss on assistant tokens' in line and '0 dropped as over-long' in line
    assert sorted(os.listdir(tmp_path / 'o')) == ['c.tokenizer.json', 'c_train.bin', 'c_train.json',
                                                  'c_train.mask.bin', 'c_val.bin', 'c_val.json', 'c_val.mask.bin']


# --------------------------------------------------------------------------- bad input


def _records(*records):
    return lambda t: write_jsonl(t / 'bad.jsonl', list(records))


BAD_CONVERSATIONS = {  # name: (the input file given tmp_path, tokenizer template, words in the one line)
    'no assistant turn': (_records({'messages': conversation(('user', 'hi'))}), CHATML,
                          ['line 1', 'no assistant turn']),
    'no assistant turn in the completion': (_records({'prompt': conversation(('user', 'hi'), ('assistant', 'ok')),
                                                      'completion': conversation(('user', 'bye'))}), CHATML,
                                            ['no assistant turn in its completion']),
    'unknown role': (_records({'messages': conversation(('user', 'hi'), ('assistant', 'ok'))},
                              {'messages': [{'role': 'human', 'content': 'hi'}, {'role': 'gpt', 'content': 'ok'}]}),
                     CHATML, ['line 2', "unknown role 'human'"]),
    'no chat template': (_records({'messages': conversation(('user', 'hi'), ('assistant', 'ok'))}), None,
                         ['has no chat template', 'line 1']),
    'template rewrites history': (_records({'messages': CONVERSATIONS[0]}), REWRITING,
                                  ['line 1', 'do not begin its whole rendering']),
    'template refuses': (_records({'messages': CONVERSATIONS[2]}), RAISING, ['roles must alternate']),
    'neither messages nor pair': (_records({'text': 'hi'}), CHATML, ['neither "messages" nor', "['text']"]),
    'content not a string': (_records({'messages': [{'role': 'user', 'content': ['hi']}]}), CHATML,
                             ['content of type list']),
    'messages not a list': (_records({'messages': 'hi'}), CHATML, ['is a JSON str, not a list']),
    'no messages': (_records({'messages': []}), CHATML, ['"messages" holds no message']),
    'assistant first': (_records({'messages': conversation(('assistant', 'hi'), ('user', 'ok'))}), CHATML,
                        ['opens with an assistant turn']),
    'line not JSON': (lambda t: (t / 'bad.jsonl').write_text('{"messages": [\n') and str(t / 'bad.jsonl'), CHATML,
                      ['line 1 is not JSON']),
    'not jsonl': (lambda t: (t / 'bad.txt').write_text('hi') and str(t / 'bad.txt'), CHATML, ['.jsonl files']),
    'everything dropped': (_records({'messages': CONVERSATIONS[0]}), CHATML, ['no conversation to write', '1 dropped']),
}


@pytest.mark.parametrize('name', list(BAD_CONVERSATIONS))
def test_bad_conversations_are_one_line_and_nothing_is_written(tmp_path, name):
    make_input, template, words = BAD_CONVERSATIONS[name]
    source = make_input(tmp_path)
    tokenizer = make_tokenizer(tmp_path / 'tok', template)
    options = sft.Options(max_tokens=5, overlong='drop') if name == 'everything dropped' else sft.Options()
    with pytest.raises(UserError) as e:
        sft.prepare([source], str(tmp_path / 'out' / 'x'), tokenizer_path=tokenizer, options=options,
                    split=documents.Split(val_documents=1))
    message = str(e.value)
    assert '\n' not in message and 'Fix:' in message, message
    for word in words:
        assert word in message, (word, message)
    assert not os.path.exists(tmp_path / 'out') or os.listdir(tmp_path / 'out') == []


@pytest.mark.parametrize('options,flag', [(sft.Options(loss_on='user'), 'loss_on'),
                                          (sft.Options(max_tokens=1), 'max_tokens'),
                                          (sft.Options(overlong='wrap'), 'overlong')])
def test_bad_options_are_refused_before_reading(tmp_path, tokenizer_dir, options, flag):
    with pytest.raises(FlagError) as e:
        sft.prepare([str(tmp_path / 'none.jsonl')], str(tmp_path / 'o'), tokenizer_path=tokenizer_dir, options=options)
    assert e.value.flag == flag


def _fake_transformers(t):
    (t / 'fake' / 'transformers').mkdir(parents=True)
    (t / 'fake' / 'transformers' / '__init__.py').write_text(
        "raise ImportError('no transformers', name='transformers')")
    return str(t / 'fake')


BAD_COMMAND_LINES = {  # name: (arguments given tmp_path and a good conversation file, words in the one line)
    'unknown role': (lambda t, c, k: [f'--input={_records({"messages": [{"role": "bot", "content": "x"}]})(t)}'],
                     ["unknown role 'bot'"]),
    'no chat template': (lambda t, c, k: [f'--tokenizer={make_tokenizer(t / "plain", None)}'], ['no chat template']),
    'no tokenizer': (lambda t, c, k: ['--tokenizer='], ['--tokenizer=', 'chat template']),
    'trained tokenizer': (lambda t, c, k: ['--train_tokenizer=300'], ['--train_tokenizer=300', '--tokenizer=DIR']),
    'tokenizer missing': (lambda t, c, k: [f'--tokenizer={t}/none'], ['no such file']),
    'bad loss_on': (lambda t, c, k: ['--loss_on=everything'], ['--loss_on=everything']),
    'text field with --sft': (lambda t, c, k: ['--text_field=body'], ['--text_field=body', '--messages_field']),
    'sft flag without --sft': (lambda t, c, k: ['--sft=false', '--max_tokens=10', '--train_tokenizer=300'],
                               ['--max_tokens=10', 'add --sft']),
    'transformers missing': (lambda t, c, k: [f'PYTHONPATH={_fake_transformers(t)}'],
                             ["pip install 'jaxfrontier[sft]'"]),
}


@pytest.mark.parametrize('name', list(BAD_COMMAND_LINES))
def test_bad_command_lines_are_one_line_and_exit_2(tmp_path, tokenizer_dir, name):
    make_args, words = BAD_COMMAND_LINES[name]
    good = write_jsonl(tmp_path / 'good.jsonl', [{'messages': m} for m in CONVERSATIONS])
    args = make_args(tmp_path, good, tokenizer_dir)
    env_path = [a[len('PYTHONPATH='):] for a in args if a.startswith('PYTHONPATH=')]
    args = [a for a in args if not a.startswith('PYTHONPATH=')]
    defaults = {'--sft': '--sft', '--input': f'--input={good}', '--tokenizer': f'--tokenizer={tokenizer_dir}',
                '--output': f'--output={tmp_path}/out/x'}
    args += [v for k, v in defaults.items() if not any(a.startswith(k) for a in args)
             and not (k == '--tokenizer' and any(a.startswith('--train_tokenizer') for a in args))]
    if env_path:
        done = subprocess.run([sys.executable, '-m', 'jaxfrontier.prepare', *args], cwd=REPO, capture_output=True,
                              text=True, timeout=300, env={**os.environ, 'PYTHONPATH': os.pathsep.join(
                                  env_path + [REPO])})
    else:
        done = _prepare(*args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith('error: ') and 'Fix:' in lines[0], done.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not os.path.exists(tmp_path / 'out') or os.listdir(tmp_path / 'out') == []


@pytest.mark.slow
def test_workers_give_identical_bytes(tmp_path, tokenizer_dir):
    source = write_jsonl(tmp_path / 'w.jsonl', [{'messages': m} for m in CONVERSATIONS * 20])
    outputs = []
    for workers in (1, 2):
        result = sft.prepare([source], str(tmp_path / f'w{workers}'), tokenizer_path=tokenizer_dir, workers=workers,
                             batch_bytes=500)  # many batches, several in flight
        bin_path = result.bin_paths['']
        outputs.append((open(bin_path, 'rb').read(), open(token_files.mask_path_of(bin_path), 'rb').read()))
    assert outputs[0] == outputs[1]
