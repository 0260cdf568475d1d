"""Data: token files, the built-in corpus, synthetic data, deterministic batches; corpus tokenisation.

What training reads: `token_files` (the token-file format: header, writing, memory-mapped
reading and checks, the loss mask beside it), `loss_mask` (the mask's flag bit in a batch's
tokens), `builtin` (the built-in stdlib corpus), `sampling` (per-epoch window
permutations, blends), `sources` (token, synthetic: rows as pure functions of seed, split, step),
`loader` (a run's data config checked, split into train / validation sources, global batches).
Tokenising a corpus: `corpus` (input files:
.txt / .jsonl / .parquet streamed in batches), `encode` (Hugging Face tokenizers: load or
train a byte-level BPE, encode in workers), `prepared` (the output written atomically),
`documents` (held-out documents, shuffle); conversations with a loss mask: `chat`, `sft`;
behind `python -m jaxfrontier.prepare`.
"""
