"""The whole path through the CLIs, and Hugging Face GPT-2 interop checked by `transformers` itself.

A corpus the test writes -> a byte-level BPE (`tokenizers`) -> a token file whose header names the
tokenizer (jaxfrontier.prepare's format) -> train -> sample -> eval -> export hf -> transformers
loads it: same logits (fp32, 1e-4) and the same greedy continuation. A randomly initialised
transformers GPT-2 saved with save_pretrained imports with the same logits.
"""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
tokenizers = pytest.importorskip('tokenizers')

from configs import tiny  # noqa: E402
from jaxfrontier import errors
from jaxfrontier import mesh as mesh_lib  # noqa: E402
from jaxfrontier.data import token_files  # noqa: E402
from jaxfrontier.inference import load as load_lib  # noqa: E402
from jaxfrontier.checkpoint.interop import hf  # noqa: E402
from jaxfrontier.checkpoint import readers  # noqa: E402
import processes  # noqa: E402

EOT = '<|endoftext|>'
WORDS = 'the a cat dog sat ran on under mat log big small red blue and then quickly slowly'.split()


def write_corpus(directory) -> tuple[str, int]:
    """A token file of made-up sentences, tokenised by a byte-level BPE trained on them."""
    rng = np.random.RandomState(0)
    docs = [' '.join(rng.choice(WORDS, rng.randint(5, 30))) + '.' for _ in range(1500)]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=[EOT],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    tok.save(os.path.join(directory, 'corpus.tokenizer.json'))
    eot = tok.token_to_id(EOT)
    ids = [i for doc in docs for i in tok.encode(doc).ids + [eot]]
    vocab = tok.get_vocab_size()
    token_files.write_token_file(os.path.join(directory, 'corpus.bin'), np.array(ids), vocab, metadata={
        'tokenizer': 'corpus.tokenizer.json', 'eot_id': eot, 'eot_token': EOT})
    return os.path.join(directory, 'corpus.bin'), vocab


def main(*args, log: bool = False) -> str:
    """stdout of `python -m jaxfrontier.main` (and its log on stderr when `log`); it must succeed."""
    proc = processes.run_main(*args, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout + (proc.stderr if log else '')


def our_logits(workdir: str, tokens_bt: np.ndarray) -> np.ndarray:
    """Logits of the run's newest checkpoint on the tiny mesh (data 2 x fsdp 2 x tensor 2), real vocabulary."""
    loaded = load_lib.load(tiny.get_config(), workdir)
    with jax.set_mesh(loaded.layout.mesh), mesh_lib.use_rules(loaded.layout.rules):
        logits = jax.jit(lambda p, t: loaded.layout.model_def.bind(p)(t))(loaded.params, jnp.asarray(tokens_bt))
    return np.asarray(logits)[..., :loaded.config.model.vocab_size]


@pytest.mark.slow
def test_corpus_to_transformers_through_the_clis(tmp_path):
    path, vocab = write_corpus(tmp_path)
    workdir, out = str(tmp_path / 'run'), str(tmp_path / 'hf')
    common = ('--config.data.kind=tokens', f'--config.data.path={path}', f'--config.model.vocab_size={vocab}',
              f'--workdir={workdir}')
    main(*common, '--config.train.steps=30')

    stdout = main(*common, '--mode=sample', '--prompt=the cat sat', '--temperature=0', '--max_new_tokens=12',
                  '--ignore_eot')  # as transformers below, with eos_token_id=None
    sampled = json.loads(stdout.strip().splitlines()[-1].removeprefix('sample: '))
    assert len(sampled['tokens'][0]) == 12 and sampled['tokens_per_s'] > 0

    result = json.loads(main(*common, '--mode=eval').strip().splitlines()[-1])
    assert 0 < result['loss'] < math.log(vocab)  # trained: better than uniform
    assert result['perplexity'] == pytest.approx(math.exp(result['loss']), rel=1e-5)
    assert result['bits_per_byte'] == pytest.approx(result['loss'] * result['tokens'] / math.log(2) / result['bytes'],
                                                    rel=1e-5)
    num_tokens = token_files.open_token_file(path, vocab).num_tokens
    assert result['tokens'] == num_tokens - result['first_token'] - 1  # every validation token once

    main(*common, '--mode=export', '--export_format=hf', f'--export_path={out}')
    assert {'config.json', 'model.safetensors', 'tokenizer.json'} <= set(os.listdir(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == 'GPT2LMHeadModel' and model.config.vocab_size == vocab  # real rows only

    tokens_bt = np.random.RandomState(1).randint(0, vocab, (4, 32))
    with torch.no_grad():
        theirs = model(torch.tensor(tokens_bt)).logits.numpy()
    np.testing.assert_allclose(our_logits(workdir, tokens_bt), theirs, atol=1e-4, rtol=0)

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    prompt = torch.tensor([hf_tok.encode('the cat sat')])
    with torch.no_grad():
        greedy = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert greedy[0, prompt.shape[1]:].tolist() == sampled['tokens'][0]

    # fine-tuning starts from the Hugging Face directory (checkpoint.init_params_from=<dir>)
    tuned = main(*common[:-1], f'--workdir={tmp_path / "tuned"}', f'--config.checkpoint.init_params_from={out}',
                 '--config.train.steps=1', log=True)
    assert f'parameters from {out}' in tuned

    # the checkpoint stores block arrays in one-layer chunks: the export reads one layer at a time
    step_dir = readers.step_dir_of(workdir)
    reader = readers.ParamReader(step_dir, readers.read_meta(step_dir)['config'])
    assert reader.open('blocks/mlp/w_in').chunk_layout.read_chunk.shape[0] == 1


@pytest.mark.slow
@pytest.mark.parametrize('tied', [True, False])
def test_transformers_gpt2_imports_with_equal_logits(tmp_path, tied):
    config = transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                     tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(tmp_path / 'gpt2')
    c = tiny.get_config()  # data 2 x fsdp 2 x tensor 2: vocabulary padded to 512
    c.checkpoint.init_params_from = str(tmp_path / 'gpt2')
    loaded = load_lib.load(c, str(tmp_path / 'no_run'))
    assert loaded.config.model.num_layers == 2 and loaded.config.model.tied_embeddings == tied
    tokens_bt = np.random.RandomState(2).randint(0, 300, (4, 32))
    with jax.set_mesh(loaded.layout.mesh), mesh_lib.use_rules(loaded.layout.rules):
        ours = jax.jit(lambda p, t: loaded.layout.model_def.bind(p)(t))(loaded.params, jnp.asarray(tokens_bt))
    with torch.no_grad():
        theirs = model(torch.tensor(tokens_bt)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours)[..., :300], theirs, atol=1e-4, rtol=0)


def test_non_gpt2_config_is_refused(tmp_path):
    with pytest.raises(errors.ConfigError, match='activation_function'):
        hf.model_fields({'model_type': 'gpt2', 'activation_function': 'relu', 'n_embd': 8, 'n_layer': 1,
                         'n_head': 2, 'vocab_size': 10, 'n_positions': 8}, str(tmp_path))
