"""Flax NNX decoders: layers/ (by concern: the matmul seam linear.py, norms, MLPs, embedding, loss, rope),
attention/ (kernels, KV cache), stack.py (the layer runner), decoder.py (what every family's module
shares), a module per family (its NNX model, declared in jaxfrontier/families/), params.py (binds and
builds the configured family's module), decode.py."""
