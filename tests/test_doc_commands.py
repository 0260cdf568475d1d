"""The shell commands of the user docs, as written (issue 39; benchmarks/doc_commands.py).

Fast: every command is extracted and classified, with a reason for each that does not run here, and
the commands a new user meets first on a CPU (an HF model on a mesh of several devices) say how
the CPU gets those devices. Slow: docs/inference.md's Llama journey (tokenise with the model's
tokenizer, continue its training on 8 simulated devices, sample, export, load in transformers)
runs command by command, as written, in one directory holding the files the doc assumes the user
has: models/llama-1b (a tiny random LlamaForCausalLM with a tokenizer) and mydata/*.jsonl.
"""

import json
import os
import re
import sys

import pytest

import processes

sys.path.insert(0, os.path.join(processes.REPO, 'benchmarks'))
import doc_commands  # noqa: E402  (benchmarks/doc_commands.py)


@pytest.fixture(scope='module')
def commands():
    return doc_commands.extract()


def test_every_user_doc_command_is_extracted_and_classified(commands):
    assert {c.doc for c in commands} == set(doc_commands.USER_DOCS)
    assert len(commands) > 80, len(commands)
    for c in commands:
        assert c.kind in doc_commands.KINDS and c.reason, c
        assert '\\' not in c.text.split('"')[0] and not c.text.endswith('#'), c  # continuations joined
    kinds = {c.kind for c in commands}
    assert {'cpu', 'long', 'gpu', 'cluster', 'network', 'elided'} <= kinds
    prepare = next(c for c in commands if c.doc == 'docs/inference.md' and '--tokenizer=models/llama-1b' in c.text)
    assert prepare.kind == 'cpu' and prepare.text.endswith("--eot_token='<|end_of_text|>'"), prepare


def test_a_mesh_of_several_devices_in_an_hf_command_says_how_a_cpu_gets_them(commands):
    """Issue 39: configs/hf.py:...,fsdp=8 on a CPU stopped at 'the mesh needs 8 devices but 1 are present'."""
    for c in commands:
        if 'configs/hf.py' in c.text:
            sizes = [int(n) for n in re.findall(r'(?:data|fsdp|tensor|pipeline|context)=(\d+)', c.text)]
            if any(n > 1 for n in sizes):
                assert 'cpu_devices=' in c.text, c
        assert '/models/' not in c.text, c  # a directory the user makes beside the run (models/...), as the test does


def _tiny_llama(directory):
    """A random 2-layer LlamaForCausalLM and a byte-level BPE tokenizer with Llama 3's end-of-text token."""
    tokenizers = pytest.importorskip('tokenizers')
    transformers = pytest.importorskip('transformers')
    pytest.importorskip('torch')
    words = 'the capital of france is paris a cat sat on mat and then ran under big red log'.split()
    texts = [' '.join(words[(i * 7 + j) % len(words)] for j in range(8 + i % 23)) + '.' for i in range(5000)]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(
        vocab_size=320, special_tokens=['<|end_of_text|>'], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(directory)
    tok.save(os.path.join(directory, 'tokenizer.json'))
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    with open(os.path.join(directory, 'tokenizer_config.json'), 'w') as f:
        json.dump({'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': '<|end_of_text|>'}, f)
    return texts


@pytest.mark.slow
def test_the_llama_journey_of_the_inference_doc_runs_as_written(commands, tmp_path):
    journey = [c for c in commands if c.doc == 'docs/inference.md' and c.kind == 'cpu'
               and doc_commands.CPU_JOURNEY.search(c.text)]
    assert len(journey) == 5, [c.text for c in journey]
    texts = _tiny_llama(tmp_path / 'models' / 'llama-1b')
    (tmp_path / 'mydata').mkdir()
    with open(tmp_path / 'mydata' / 'part0.jsonl', 'w') as f:
        f.writelines(json.dumps({'text': t}) + '\n' for t in texts)
    doc_commands.prepare_dir(str(tmp_path))
    outputs = []
    for c in journey:
        proc = doc_commands.run(c, str(tmp_path))
        assert proc.returncode == 0, (c.line, c.text, proc.stderr[-3000:])
        outputs.append(proc.stdout + proc.stderr)
    train, sample, export, load = outputs[1:]
    assert 'computing in bfloat16' in train and 'remat full' in train, train[-3000:]
    assert 'windows across documents (pack_documents=False)' in train, train[-3000:]
    done = json.loads(train.split('done: ', 1)[1].splitlines()[0])
    assert done['step'] == 20 and done['train/lr'] > 0, done  # six significant digits, not four decimals
    assert 'compute: float32 on the CPU' in sample, sample[-3000:]
    assert 'max positions: 512' in export, export[-2000:]
    assert load.strip(), load
