"""The lm-evaluation-harness adapter: requests scored on a split mesh equal a direct one-device computation.

The fast test drives inference/scoring.py (no lm-eval needed) on data 2 x fsdp 2 x tensor 2
(vocabulary and heads split) against the model's plain forward on one device. The slow test runs
`--mode=lm_eval` on a multiple-choice, a generation and a perplexity task it writes (task YAMLs
and JSONL data, read by the harness's `json` loader: no download) and checks every choice's
log-likelihood and the accuracy, every generated text and every document's log-likelihood
against the same direct computation.
"""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxfrontier import config as config_lib
from jaxfrontier.checkpoint import readers
from jaxfrontier.errors import UserError
from jaxfrontier.inference import load as load_lib
from jaxfrontier.inference import scoring
from jaxfrontier.model.params import ModelDef
import processes
from test_inference import small_config, sharp_params


def direct_logprob(forward, params, context, continuation, seq_len):
    """Sum of log p(continuation token | everything before it), one unpadded row on one device."""
    whole = (context + continuation)[-(seq_len + 1):]
    row = np.zeros((1, seq_len), np.int32)  # zeros after the row change nothing before them (causal): one compile
    row[0, :len(whole) - 1] = whole[:-1]
    logits = np.asarray(forward(params, row), np.float64)[0, :len(whole) - 1]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)
    first = len(whole) - 1 - len(continuation)
    picked = [logp[first + i, t] for i, t in enumerate(continuation)]
    greedy = all(logits[first + i].argmax() == t for i, t in enumerate(continuation))
    return float(np.sum(picked)), greedy


@pytest.fixture(scope='module')
def one_device(tmp_path_factory):
    """Parameters as a .safetensors file, and the model's forward on one device (real vocabulary only).

    Made with the split mesh's config, so the vocabulary is padded as that mesh pads it (512 rows).
    """
    c = small_config(data=2, fsdp=2, tensor=2)
    params = sharp_params(c)
    path = str(tmp_path_factory.mktemp('lm_eval') / 'params.safetensors')
    save_file({n: np.asarray(a, np.float32) for n, a in readers.flatten_names(params).items()}, path)
    model_def, real = ModelDef.create(config_lib.model_shape(c)), c.model.vocab_size
    return path, params, jax.jit(lambda p, t: model_def.bind(p)(t)[..., :real])


def test_scores_on_a_split_mesh_equal_one_device(one_device, tmp_path):
    path, params, forward = one_device
    c = small_config(data=2, fsdp=2, tensor=2)
    c.checkpoint.init_params_from = path
    loaded = load_lib.load(c, str(tmp_path / 'none'))
    seq_len = c.model.seq_len  # 40
    rng = np.random.default_rng(0)

    def ids(n):
        return rng.integers(0, c.model.vocab_size, n).tolist()

    requests = [(ids(3), ids(2)), (ids(17), ids(5)), (ids(1), ids(1)), (ids(50), ids(7)),  # 50 + 7 > 40: cut
                (ids(9), ids(40)), (ids(20), [])]
    greedy_context = ids(6)
    run = greedy_context
    for _ in range(3):  # the greedy continuation, computed directly
        row = np.zeros((1, seq_len), np.int32)
        row[0, :len(run)] = run
        run = run + [int(np.asarray(forward(params, row))[0, len(run) - 1].argmax())]
    requests.append((greedy_context, run[6:]))
    scorer = scoring.Scorer(loaded, batch_rows=3)  # 4 rows per batch (data x fsdp 4): two batches of two widths
    assert scorer.rows == 4
    got = scorer.score(requests)
    for (context, continuation), score in zip(requests, got):
        expected, greedy = direct_logprob(forward, params, context, continuation, seq_len)
        np.testing.assert_allclose(score.logprob, expected, rtol=2e-6, atol=2e-5)
        assert score.greedy == greedy
    assert got[-1].greedy and not got[0].greedy and got[5] == scoring.Score(0.0, True)
    assert [scoring.width_for(n, seq_len) for n in (1, 16, 17, 33, 40)] == [16, 16, 32, 40, 40]
    with pytest.raises(UserError, match='continuation of 41 tokens is longer than the model'):
        scorer.score([([1], [2] * 41)])


# --------------------------------------------------------------------------- through the harness

HEAD = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""
CHOICE = """output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GENERATE = """output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: [{until}]
  max_gen_toks: {max_new}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
ROLLING = """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
"""

# Choices without their leading space: the harness puts its target_delimiter (" ") between question and choice.
DOCS = [dict(question='def f(x):', choices=['return x', 'pass', 'yield'], answer=0),
        dict(question='import', choices=['os', 'sys', 're', 'json'], answer=1),
        dict(question='The quick brown', choices=['fox', 'dog'], answer=0),
        dict(question='1 + 1 =', choices=['2', '3', '11'], answer=2),
        dict(question='for i in', choices=['range(3):', 'x:'], answer=1)]
# Documents for perplexity: one of 4 windows of the model's 40 positions, one of a single window.
TEXTS = [dict(text='The quick brown fox jumps over the lazy dog; ' * 2 + 'pack my box with five dozen jugs.'),
         dict(text='import os')]
MAX_NEW = 8


def greedy_text(forward, params, prompt, max_new, seq_len):
    """Greedy bytes after `prompt`, recomputing the whole row each step (no cache), on one device."""
    run = list(prompt.encode())
    for _ in range(max_new):
        row = np.zeros((1, seq_len), np.int32)
        row[0, :len(run)] = run
        run.append(int(np.asarray(forward(params, row))[0, len(run) - 1].argmax()))
    return bytes(run[len(prompt.encode()):]).decode()


@pytest.mark.slow  # the harness's import (~10 s) and forward and decode compiles on 8 simulated devices
def test_cli_tasks_equal_direct_computation(tmp_path):
    """A multiple-choice, a generation and a perplexity task through --mode=lm_eval on data 2 x fsdp 2 x
    tensor 2: every log-likelihood and every generated text as computed directly on one device."""
    lm_utils = pytest.importorskip('lm_eval.utils', reason='lm-eval is an optional extra '
                                   '(pip install jaxfrontier[lm_eval])')
    # test_sampling's CLI model (it imports torch: only here, not in the fast tier's import)
    from test_sampling import PRINTABLE, cli_config, printable_params  # pylint: disable=import-outside-toplevel
    c, model_flags = cli_config('gpt')
    seq_len, real = c.model.seq_len, c.model.vocab_size
    model_def = ModelDef.create(config_lib.model_shape(c))
    forward = jax.jit(lambda p, t: model_def.bind(p)(t)[..., :real])
    one_params = sharp_params(c)  # as printable_params writes them: rows of unprintable tokens zeroed
    keep = np.isin(np.arange(one_params['wte'].shape[0]), PRINTABLE)
    one_params = {**one_params, 'wte': one_params['wte'] * keep[:, None]}
    greedy = [greedy_text(forward, one_params, d['question'], MAX_NEW, seq_len) for d in DOCS]
    stop = next(greedy[0][i:i + 2] for i in range(2, MAX_NEW - 2) if greedy[0][i:i + 2].strip(' "\\'))

    tasks = tmp_path / 'tasks'
    tasks.mkdir()
    for name, docs, body in (('jf_choice', DOCS, CHOICE), ('jf_gen', DOCS, GENERATE), ('jf_roll', TEXTS, ROLLING)):
        (tmp_path / f'{name}.jsonl').write_text(''.join(json.dumps(d) + '\n' for d in docs))
        (tasks / f'{name}.yaml').write_text(HEAD.format(name=name, data=tmp_path / f'{name}.jsonl') +
                                            body.format(until=json.dumps(stop), max_new=MAX_NEW))
    params = printable_params('gpt', str(tmp_path / 'gpt.safetensors'))
    out = tmp_path / 'results.json'
    proc = subprocess.run([sys.executable, '-m', 'jaxfrontier.main', '--config=configs/tiny.py', *model_flags,
                           '--mode=lm_eval', f'--workdir={tmp_path / "none"}',
                           f'--config.checkpoint.init_params_from={params}', '--tasks=jf_choice,jf_gen,jf_roll',
                           f'--lm_eval_include={tasks}', f'--lm_eval_json={out}', '--lm_eval_batch=5'],
                          cwd=processes.REPO, capture_output=True, text=True, timeout=600,
                          env=processes.subprocess_env(HF_DATASETS_OFFLINE='1', HF_HOME=str(tmp_path / 'hf')))
    assert proc.returncode == 0, proc.stderr[-3000:]
    reported = json.loads(proc.stdout.splitlines()[-1].removeprefix('lm_eval: '))
    samples = {task: sorted(rows, key=lambda s: s['doc_id']) for task, rows in json.loads(out.read_text())['samples'].items()}

    correct = 0
    for doc, s in zip(DOCS, samples['jf_choice'], strict=True):
        direct = [direct_logprob(forward, one_params, list(doc['question'].encode()), list(b' ' + choice.encode()),
                                 seq_len)[0] for choice in doc['choices']]
        np.testing.assert_allclose([float(r[0][0]) for r in s['resps']], direct, rtol=2e-6, atol=2e-5)
        correct += int(np.argmax(direct)) == doc['answer']
    assert reported['jf_choice']['acc,none'] == correct / len(DOCS)

    from lm_eval.api.registry import get_model  # pylint: disable=import-outside-toplevel
    from jaxfrontier.inference import harness  # pylint: disable=import-outside-toplevel
    assert get_model('jaxfrontier') is harness.JaxFrontierLM  # what lm_eval.simple_evaluate(model='jaxfrontier') finds

    expected = [text[:text.find(stop)] if stop in text else text for text in greedy]
    assert [s['resps'][0][0] for s in samples['jf_gen']] == expected
    assert expected[0] != greedy[0]  # the stop string cut it

    for doc, s in zip(TEXTS, samples['jf_roll'], strict=True):
        tokens = list(doc['text'].encode())
        windows = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
            token_list=tokens, prefix_token=ord('\n'), max_seq_len=seq_len, context_len=1)]
        assert sum(len(w[1]) for w in windows) == len(tokens) and len(windows) == -(-len(tokens) // seq_len)
        direct = sum(direct_logprob(forward, one_params, ctx, cont, seq_len)[0] for ctx, cont in windows)
        np.testing.assert_allclose(float(s['resps'][0][0]), direct, rtol=2e-6, atol=2e-5)


@pytest.mark.parametrize('flags, named', [([], '--mode=lm_eval needs --tasks'),
                                          (['--tasks=arc_easy', '--limit=-1'], '--limit=-1.0: must be >= 0'),
                                          (['--tasks=arc_easy', '--lm_eval_include=/no/such'], 'is not a directory')])
def test_cli_flag_mistakes_are_one_line(tmp_path, flags, named):
    """Refused before JAX or the harness is imported."""
    proc = subprocess.run([sys.executable, '-m', 'jaxfrontier.main', '--config=configs/tiny.py', '--mode=lm_eval',
                           f'--workdir={tmp_path / "none"}', *flags], cwd=processes.REPO, capture_output=True,
                          text=True, timeout=300, env=processes.subprocess_env())
    assert proc.returncode == 2 and proc.stderr.count('\n') == 1, proc.stderr[-2000:]
    assert named in proc.stderr and 'Fix:' in proc.stderr


@pytest.mark.slow  # the harness's import and its index of every task it ships (~20 s)
def test_cli_unknown_task_is_one_line(tmp_path):
    pytest.importorskip('lm_eval', reason='lm-eval is an optional extra (pip install jaxfrontier[lm_eval])')
    proc = subprocess.run([sys.executable, '-m', 'jaxfrontier.main', '--config=configs/tiny.py', '--mode=lm_eval',
                           f'--workdir={tmp_path / "none"}', '--tasks=arc_easy,no_such_task'], cwd=processes.REPO,
                          capture_output=True, text=True, timeout=300, env=processes.subprocess_env(HF_DATASETS_OFFLINE='1'))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "unknown task(s) ['no_such_task']" in proc.stderr and 'Fix:' in proc.stderr
    assert 'Traceback' not in proc.stderr
