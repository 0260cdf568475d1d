"""The feed-forward halves of the blocks: GPT's GeLU MLP and Llama's SwiGLU."""

from __future__ import annotations

import jax
from flax import nnx

from jaxfrontier import mesh as mesh_lib
from jaxfrontier.model.layers.base import ACT_ND, param


class MLP(nnx.Module):
    """GeLU MLP: column-parallel input projection, row-parallel output projection."""

    def __init__(self, d_model: int, mlp_dim: int, *, init_std: float, out_std: float, rngs: nnx.Rngs):
        self.w_in = param(rngs.params(), (d_model, mlp_dim), ('embed', 'mlp'), init_std)
        self.b_in = param(None, (mlp_dim,), ('mlp',), 0.0)
        self.w_out = param(rngs.params(), (mlp_dim, d_model), ('mlp', 'embed'), out_std)
        self.b_out = param(None, (d_model,), ('embed',), 0.0)

    def __call__(self, x_nd: jax.Array) -> jax.Array:
        dtype = x_nd.dtype
        h_nf = x_nd @ self.w_in[...].astype(dtype) + self.b_in[...].astype(dtype)
        h_nf = mesh_lib.constrain(jax.nn.gelu(h_nf), ('tokens', 'mlp'))
        y_nd = h_nf @ self.w_out[...].astype(dtype) + self.b_out[...].astype(dtype)
        return mesh_lib.constrain(y_nd, ACT_ND)


class SwiGLU(nnx.Module):
    """Llama's gated MLP, silu(x W_gate) * (x W_up) W_down, no biases.

    Gate and up are column-parallel over `mlp` (each tensor rank holds the same columns of
    both, so the product stays local); down is row-parallel and ends in one all-reduce.
    """

    def __init__(self, d_model: int, mlp_dim: int, *, init_std: float, out_std: float, rngs: nnx.Rngs):
        self.w_gate = param(rngs.params(), (d_model, mlp_dim), ('embed', 'mlp'), init_std)
        self.w_up = param(rngs.params(), (d_model, mlp_dim), ('embed', 'mlp'), init_std)
        self.w_down = param(rngs.params(), (mlp_dim, d_model), ('mlp', 'embed'), out_std)

    def __call__(self, x_nd: jax.Array) -> jax.Array:
        dtype = x_nd.dtype
        gate_nf = x_nd @ self.w_gate[...].astype(dtype)
        up_nf = x_nd @ self.w_up[...].astype(dtype)
        h_nf = mesh_lib.constrain(jax.nn.silu(gate_nf) * up_nf, ('tokens', 'mlp'))
        return mesh_lib.constrain(h_nf @ self.w_down[...].astype(dtype), ACT_ND)
