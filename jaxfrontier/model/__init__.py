"""Flax NNX decoders: layers.py, attention.py (kernels, KV cache), stack.py (the layer runner), a module per
family (gpt.py) declaring itself (family.py, registry.py), params.py, decode.py."""
