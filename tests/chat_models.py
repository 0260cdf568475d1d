"""Tiny chat models for the post-training tests, made here without a network: a Hugging Face
directory holding a random LlamaForCausalLM (2 layers, width 32, 4 heads, 2 kv heads) and a
WordLevel tokenizer whose tokenizer_config.json carries a ChatML template, so a conversation's
tokens are [<|im_start|>, role, words..., <|im_end|>] per message.

The conversations teach one rule a tiny model learns in a few dozen steps: the user names a
number word and the assistant answers the next one ("what follows three" -> "four").
"""

import json
import os

import numpy as np
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

SPECIAL = ['<unk>', '<|endoftext|>', '<|im_start|>', '<|im_end|>']
NUMBERS = 'one two three four five six seven eight nine ten'.split()
WORDS = 'system user assistant what follows is it not no yes good bad'.split() + NUMBERS
VOCAB = {t: i for i, t in enumerate(SPECIAL + WORDS)}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MODEL_VOCAB = 64  # the model's rows: more than the tokenizer's, as real checkpoints pad theirs


def save_tokenizer(directory, template=CHATML):
    """tokenizer.json + tokenizer_config.json (with `template` unless None) in `directory`."""
    tokenizer = Tokenizer(models.WordLevel(VOCAB, unk_token='<unk>'))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(s, special=True) for s in SPECIAL[1:]])
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, 'tokenizer.json'))
    config = {'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': '<|endoftext|>', 'unk_token': '<unk>'}
    if template is not None:
        config['chat_template'] = template
    with open(os.path.join(directory, 'tokenizer_config.json'), 'w') as f:
        json.dump(config, f)
    return str(directory)


def save_chat_llama(directory, template=CHATML):
    """A random tiny Llama and the chat tokenizer, as one Hugging Face directory."""
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
    config = transformers.LlamaConfig(vocab_size=MODEL_VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=False,
                                      bos_token_id=VOCAB['<|endoftext|>'], eos_token_id=VOCAB['<|endoftext|>'])
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return save_tokenizer(directory, template)


def question(i):
    return [{'role': 'user', 'content': f'what follows {NUMBERS[i]}'}]


def conversations(n, seed=0):
    """`n` conversations of the rule in the module docstring ({"messages": [...]} records)."""
    rng = np.random.default_rng(seed)
    return [{'messages': question(i) + [{'role': 'assistant', 'content': NUMBERS[i + 1]}]}
            for i in rng.integers(0, len(NUMBERS) - 1, n)]


def preference_pairs(n, seed=0, rule=False):
    """`n` pairs: the prompt a question, chosen the right answer, rejected a wrong one.

    `rule`: the chosen answer also says 'yes' first and the rejected 'no', a preference every pair shares
    whatever its prompt. Without it the preference is conditional on the prompt (every number word is chosen
    for one question and rejected for others), which a random tiny model does not learn in a few dozen steps:
    held-out pairs' margins did not rise (docs/post_training.md)."""
    rng = np.random.default_rng(seed)
    pairs = []
    for i in rng.integers(0, len(NUMBERS) - 1, n):
        wrong = (i + 1 + rng.integers(1, len(NUMBERS) - 1)) % len(NUMBERS)
        chosen, rejected = NUMBERS[i + 1], NUMBERS[wrong]
        if rule:
            chosen, rejected = f'yes {chosen}', f'no {rejected}'
        pairs.append({'prompt': question(i)[0]['content'], 'chosen': chosen, 'rejected': rejected})
    return pairs


def write_jsonl(path, records):
    with open(path, 'w') as f:
        f.writelines(json.dumps(r) + '\n' for r in records)
    return str(path)
