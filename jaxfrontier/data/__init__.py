"""Data: token files, the built-in corpus, synthetic data, deterministic batches."""
