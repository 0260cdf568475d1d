"""Flax NNX GPT: layers.py (norm, MLP, dropout), attention.py (kernels + dispatch), gpt.py."""
