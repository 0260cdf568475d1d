"""Llama against GPT at equal parameters, and against a PyTorch Llama of the same shape, in one process.

  JAX_PLATFORMS=cpu python benchmarks/compare_llama.py [--rounds 3] [--steps 10] [--no-torch]

Shape: compare_baseline.py's CPU benchmark shape (docs/PERFORMANCE.md): 6 layers, width 384,
6 heads, sequence 256, vocabulary 512, batch 8, fp32, one device, AdamW, no remat, tied
embeddings. The Llama has 2 key/value heads (grouped-query attention, head dim 64) and its
SwiGLU width chosen so that its parameter count equals the GPT's within a few hundred
parameters (printed). The PyTorch peer is `transformers.LlamaForCausalLM` of the same config
(sdpa attention) under torch.compile with the same AdamW and clipping (torch_gpt.py's step).

Each round times the three back to back; the machine is shared and noisy, so the result is
the ratio of medians over rounds. FLOP convention: each family's model FLOPs in Megatron's
convention (flops.py; Llama's by Megatron-LM's GQA/SwiGLU count), f = 3, over the measured
fp32 matmul peak of this CPU: MFU compares the two families' useful work fairly, and the
tokens/s ratio compares their speed at equal parameters.
"""

import argparse
import json
import os
import statistics
import sys

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
from jaxfrontier import config as config_lib  # noqa: E402
from jaxfrontier import families  # noqa: E402

LAYERS, D, HEADS, KV_HEADS, SEQ, VOCAB, BATCH = 6, 384, 6, 2, 256, 512, 8


def base(family: str, mlp_dim: int = 0):
    c = config_lib.base_config()
    c.model.update(family=family, num_layers=LAYERS, d_model=D, num_heads=HEADS, seq_len=SEQ, vocab_size=VOCAB,
                   vocab_multiple=128, dtype='float32', remat='none', attention='auto', tied_embeddings=True,
                   scan_unroll=1)
    if family == 'llama':
        c.model.update(num_kv_heads=KV_HEADS, mlp_dim=mlp_dim, rope_theta=10000.0)
    c.train.update(global_batch=BATCH, micro_batch=BATCH, accum_steps=1)
    c.data.kind = 'synthetic'
    return c


def count(c) -> int:
    shape = config_lib.model_shape(c)
    return sum(p.size for p in families.get(shape.family).param_specs(shape))


def equal_parameter_llama():
    """The Llama config whose parameter count is nearest the GPT's (its SwiGLU width searched)."""
    target = count(base('gpt'))
    width = min(range(8, 8 * D), key=lambda f: abs(count(base('llama', f)) - target))
    return base('llama', width), target


def torch_llama_step_time(c, steps: int, warmup: int) -> dict:
    """transformers' LlamaForCausalLM of config `c`'s shape, timed by torch_gpt.time_step (torch.compile)."""
    import torch  # pylint: disable=g-import-not-at-top  (needs the test extra)
    import torch.nn.functional as F  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    import torch_gpt  # pylint: disable=g-import-not-at-top
    m = c.model
    hf = transformers.LlamaConfig(vocab_size=config_lib.padded_vocab(c), hidden_size=m.d_model,
                                  intermediate_size=m.mlp_dim, num_hidden_layers=m.num_layers,
                                  num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
                                  max_position_embeddings=m.seq_len, rms_norm_eps=m.norm_eps,
                                  tie_word_embeddings=True, attn_implementation='sdpa')

    class Loss(torch.nn.Module):
        """The mean next-token loss of the HF model: torch_gpt's `forward(tokens, targets)`."""

        def __init__(self):
            super().__init__()
            self.llama = transformers.LlamaForCausalLM(hf)

        def forward(self, tokens, targets):
            logits = self.llama(input_ids=tokens).logits
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return torch_gpt.time_step(c, steps=steps, warmup=warmup, model=Loss())


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--rounds', type=int, default=3)
    p.add_argument('--steps', type=int, default=10)
    p.add_argument('--no-torch', dest='torch', action='store_false', help='skip the PyTorch Llama peer')
    args = p.parse_args()
    gpt = base('gpt')
    llama, target = equal_parameter_llama()
    print(json.dumps({'gpt_params': target, 'llama_params': count(llama), 'llama_mlp_dim': llama.model.mlp_dim}),
          flush=True)
    rows = {'gpt': [], 'llama': [], **({'torch_llama': []} if args.torch else {})}
    mfu = {'gpt': [], 'llama': []}
    for r in range(args.rounds):
        for name, c in (('gpt', gpt), ('llama', llama)):
            out = harness.time_train_step(c, steps=args.steps, warmup=2)
            rows[name].append(out['perf/tokens_per_s'])
            mfu[name].append(out['perf/mfu'])
        if args.torch:
            rows['torch_llama'].append(torch_llama_step_time(llama, args.steps, 2)['tokens_per_s'])
        print(json.dumps({'round': r, **{f'{k}_tokens_per_s': v[-1] for k, v in rows.items()},
                          **{f'{k}_mfu': v[-1] for k, v in mfu.items()}}), flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    summary = {**{f'{k}_tokens_per_s': v for k, v in med.items()},
               **{f'{k}_mfu': statistics.median(v) for k, v in mfu.items()},
               'llama_over_gpt': med['llama'] / med['gpt'],
               **({'llama_over_torch_llama': med['llama'] / med['torch_llama']} if args.torch else {})}
    print(json.dumps(summary))


if __name__ == '__main__':
    main()
