"""Data: token files, the built-in corpus, synthetic data, deterministic batches; corpus tokenisation.

`dataset` (token-file format, sampling, batches; what training reads), `corpus` (input files:
.txt / .jsonl / .parquet streamed in batches), `encode` (Hugging Face tokenizers: load or
train a byte-level BPE, encode in workers, write a token file atomically; behind
`python -m jaxfrontier.prepare`).
"""
