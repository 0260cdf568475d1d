"""The feed-forward halves of the blocks: GPT's GeLU MLP and Llama's SwiGLU, their matmuls through linear.py."""

from __future__ import annotations

import jax
from flax import nnx

from jaxfrontier import mesh as mesh_lib
from jaxfrontier.families import Lora
from jaxfrontier.model.layers import linear
from jaxfrontier.model.layers.base import ACT_ND, param


class MLP(nnx.Module):
    """GeLU MLP: column-parallel input projection, row-parallel output projection."""

    def __init__(self, d_model: int, mlp_dim: int, *, init_std: float, out_std: float, rngs: nnx.Rngs,
                 lora: Lora | None = None):
        self.w_in = param(rngs.params(), (d_model, mlp_dim), ('embed', 'mlp'), init_std)
        self.b_in = param(None, (mlp_dim,), ('mlp',), 0.0)
        self.w_out = param(rngs.params(), (mlp_dim, d_model), ('mlp', 'embed'), out_std)
        self.b_out = param(None, (d_model,), ('embed',), 0.0)
        for name in ('w_in', 'w_out'):  # LoRA adapters of the targeted ones (linear.adapt)
            linear.adapt(self, name, lora, rngs)

    def __call__(self, x_nd: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """The MLP on `x_nd` [N, d]; `key`: LoRA adapters' dropout (training)."""
        h_nf = linear.project(self, 'w_in', 'nd,df->nf', x_nd, bias='b_in', key=key)
        h_nf = mesh_lib.constrain(jax.nn.gelu(h_nf), ('tokens', 'mlp'))
        return linear.project(self, 'w_out', 'nf,fd->nd', h_nf, bias='b_out', out_names=ACT_ND, key=key)


class SwiGLU(nnx.Module):
    """The gated (SwiGLU) MLP, silu(x W_gate) * (x W_up) W_down, no biases.

    Gate and up are column-parallel over `mlp` (each tensor rank holds the same columns of
    both, so the product stays local); down is row-parallel and ends in one all-reduce.
    """

    def __init__(self, d_model: int, mlp_dim: int, *, init_std: float, out_std: float, rngs: nnx.Rngs,
                 lora: Lora | None = None):
        self.w_gate = param(rngs.params(), (d_model, mlp_dim), ('embed', 'mlp'), init_std)
        self.w_up = param(rngs.params(), (d_model, mlp_dim), ('embed', 'mlp'), init_std)
        self.w_down = param(rngs.params(), (mlp_dim, d_model), ('mlp', 'embed'), out_std)
        for name in ('w_gate', 'w_up', 'w_down'):  # LoRA adapters of the targeted ones (linear.adapt)
            linear.adapt(self, name, lora, rngs)

    def __call__(self, x_nd: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """The gated MLP on `x_nd` [N, d]; `key`: LoRA adapters' dropout (training)."""
        gate_nf = linear.project(self, 'w_gate', 'nd,df->nf', x_nd, key=key)
        up_nf = linear.project(self, 'w_up', 'nd,df->nf', x_nd, key=key)
        h_nf = mesh_lib.constrain(jax.nn.silu(gate_nf) * up_nf, ('tokens', 'mlp'))
        return linear.project(self, 'w_down', 'nf,fd->nd', h_nf, out_names=ACT_ND, key=key)
