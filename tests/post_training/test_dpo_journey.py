"""docs/post_training.md's DPO journey, end to end on tiny models made here (tests/chat_models.py):
a Hugging Face Llama directory and a JSONL of preference pairs -> `prepare --dpo` -> configs/dpo.py
on data 2 x fsdp 2 x tensor 2 (the reference a frozen copy of the start) with its dpo/* metrics and
the held-out pairs' margins and accuracy (rising, equal to transformers' margin of the export) -> a
Hugging Face export that transformers loads and that prefers the chosen answers. Each command is the
documented one."""

import json

import numpy as np
import pytest

transformers = pytest.importorskip('transformers')
torch = pytest.importorskip('torch')

from jaxfrontier.data import dpo as dpo_data  # noqa: E402
from jaxfrontier.data import loss_mask  # noqa: E402
import chat_models  # noqa: E402
import processes  # noqa: E402

pytestmark = pytest.mark.filterwarnings('ignore:the load_module:DeprecationWarning')


run = processes.run_ok


def response_logps(model, rows):
    """Sum of the counted tokens' log-probabilities per row, by transformers."""
    ids, counted = loss_mask.token_ids(rows), (rows & loss_mask.NOT_COUNTED) == 0
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor(ids[:, :-1], dtype=torch.long)).logits, -1).numpy()
    token = np.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
    return (token * counted[:, 1:]).sum(-1)


@pytest.mark.slow
def test_dpo_from_preference_pairs_to_a_hf_model(tmp_path):
    model_dir = chat_models.save_chat_llama(tmp_path / 'model')
    pairs = chat_models.write_jsonl(tmp_path / 'pairs.jsonl', chat_models.preference_pairs(120, rule=True))
    stdout, _ = run('--dpo', f'--input={pairs}', f'--tokenizer={model_dir}', f'--output={tmp_path}/data/pairs',
                    '--seq_len=16', '--val_fraction=0.2', '--progress=false', module='jaxfrontier.prepare')
    assert 'dpo: 96 pairs (train) as rows of 17 tokens' in stdout
    workdir, out = tmp_path / 'run', tmp_path / 'dpo'
    config = (f'--config=configs/dpo.py:path={model_dir},seq_len=16,data=2,fsdp=2,tensor=2,steps=60',
              '--config.mesh.cpu_devices=8', '--config.model.dtype=float32')
    run(*config, f'--config.data.path={tmp_path}/data/pairs_train.bin',
        f'--config.data.val_path={tmp_path}/data/pairs_val.bin', '--config.optim.lr=3e-3', '--config.train.log_every=1',
        '--config.train.eval_every=60', '--config.train.eval_batches=6', '--config.train.progress=False',
        f'--workdir={workdir}')
    rows = [json.loads(line) for line in open(workdir / 'metrics.jsonl')]
    first, last = rows[0], [r for r in rows if 'eval/dpo/accuracy' in r][-1]
    assert first['dpo/loss'] == pytest.approx(np.log(2), abs=1e-6)  # step 1: the policy is the reference
    assert first['dpo/margin'] == 0 and last['train/loss'] == last['dpo/loss']
    assert last['dpo/loss'] < np.log(2) and last['dpo/accuracy'] > 0.5, last  # the training pairs are learned
    # The 24 held-out pairs (6 batches of 4) share the pairs' rule ('yes' + the right number over 'no' + a wrong
    # one): their margin rises from 0 (measured 1.81, accuracy 1.0)
    assert last['eval/dpo/margin'] > 1 and last['eval/dpo/accuracy'] > 0.9, last

    stdout, _ = run(*config, '--mode=eval', f'--workdir={workdir}')  # the run's dpo/* over its held-out pairs
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result['pairs'] == 24 and result['dpo/margin'] == pytest.approx(last['eval/dpo/margin'], rel=1e-5), result

    run(*config, '--mode=export', '--export_format=hf', f'--export_path={out}', f'--workdir={workdir}')
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    start = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    train = dpo_data.read_rows(str(tmp_path / 'data' / 'pairs_train.bin'), chat_models.MODEL_VOCAB)
    rewards = response_logps(tuned, train) - response_logps(start, train)
    assert np.mean(rewards[0::2] > rewards[1::2]) > 0.5  # transformers agrees: chosen answers gained more
    # dpo.evaluate's held-out margin, by hand: beta (0.1) x the log-probability gains by transformers
    val = dpo_data.read_rows(str(tmp_path / 'data' / 'pairs_val.bin'), chat_models.MODEL_VOCAB)
    held_out = 0.1 * (response_logps(tuned, val) - response_logps(start, val))
    assert len(val) == 48 and np.mean(held_out[0::2] - held_out[1::2]) == pytest.approx(last['eval/dpo/margin'],
                                                                                        rel=1e-4)
