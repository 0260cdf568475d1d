"""docs/post_training.md's SFT journey, end to end on tiny models made here (tests/chat_models.py):
a Hugging Face Llama directory and a JSONL of conversations -> `prepare --sft` -> configs/sft.py
training from the directory's weights on data 2 x fsdp 2 x tensor 2, the masked loss on the
held-out conversations -> `--mode=sample --chat` with the template -> a Hugging Face export that
transformers loads with the template and answers as our sampler did. Each command is the documented
one.
"""

import json
import math
import pytest

transformers = pytest.importorskip('transformers')
torch = pytest.importorskip('torch')

import chat_models  # noqa: E402
import processes  # noqa: E402

pytestmark = pytest.mark.filterwarnings('ignore:the load_module:DeprecationWarning')


run = processes.run_ok


@pytest.mark.slow
def test_sft_from_a_hf_directory_to_a_fine_tuned_hf_model(tmp_path):
    model_dir = chat_models.save_chat_llama(tmp_path / 'model')
    chats = chat_models.write_jsonl(tmp_path / 'chats.jsonl', chat_models.conversations(200))
    run('--sft', f'--input={chats}', f'--tokenizer={model_dir}', f'--output={tmp_path}/data/chats',
        '--val_fraction=0.1', '--max_tokens=33', '--progress=false', module='jaxfrontier.prepare')
    workdir, out = tmp_path / 'run', tmp_path / 'tuned'
    config = (f'--config=configs/sft.py:path={model_dir},seq_len=32,data=2,fsdp=2,tensor=2,steps=60',
              '--config.mesh.cpu_devices=8', '--config.model.dtype=float32')
    _, log = run(*config, f'--config.data.path={tmp_path}/data/chats_train.bin',
                 f'--config.data.val_path={tmp_path}/data/chats_val.bin', '--config.optim.lr=3e-3',
                 '--config.train.eval_every=60', '--config.train.progress=False', f'--workdir={workdir}')
    assert f'parameters from {model_dir}' in log
    rows = [json.loads(line) for line in open(workdir / 'metrics.jsonl')]
    evals = [r['eval/loss'] for r in rows if 'eval/loss' in r]
    # the answers (a number word and <|im_end|>) are learned: far below a uniform guess over the rows
    assert evals and evals[-1] < 0.5 * math.log(chat_models.MODEL_VOCAB), evals

    scored, _ = run(*config, '--mode=eval', f'--workdir={workdir}')
    result = json.loads(scored.strip().splitlines()[-1])
    assert result['loss_mask'] and result['loss'] < 0.5 * math.log(chat_models.MODEL_VOCAB)

    chat = json.dumps(chat_models.question(2))  # what follows three
    sampled, _ = run(*config, '--mode=sample', f'--chat={chat}', '--temperature=0', '--max_new_tokens=8',
                     f'--workdir={workdir}')
    summary = json.loads(sampled.strip().splitlines()[-1].removeprefix('sample: '))
    answer = summary['texts'][0]
    assert answer in chat_models.NUMBERS and summary['finish'] == ['eot'], summary  # a number, then <|im_end|>
    assert '<|im_start|>assistant\n' in sampled  # the prompt, rendered with the generation prompt

    run(*config, '--mode=export', '--export_format=hf', f'--export_path={out}', f'--workdir={workdir}')
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tokenizer.apply_chat_template(chat_models.question(2), add_generation_prompt=True, return_tensors='pt',
                                        return_dict=False)
    with torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert tokenizer.decode(greedy[0, ids.shape[1]:]) == f'{answer} <|im_end|>'  # transformers' greedy = ours
