"""Flax NNX decoders: layers/ (by concern, with rope.py), attention/ (kernels, KV cache), stack.py (the layer runner),
decoder.py (what every family's module shares), a module per family (gpt.py, llama.py) declaring itself
(family.py, registry.py), params.py, decode.py."""
