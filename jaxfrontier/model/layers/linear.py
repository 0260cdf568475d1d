"""The one matmul seam: every weight matmul of every family is `project(owner, name, letters, x)` (the
mixture-of-experts layer's grouped expert matmuls `project_grouped`, its router `project` in fp32).

The dtype policy, the preferred element type and the output's sharding constraint of a weight
matmul are decided here once, so a change to how weights multiply (fp8, a LoRA adapter) is one
change here, not one in each of the families' eleven matmuls (GPT's fused QKV and attention-out,
the GeLU MLP's in and out, the SwiGLU's gate, up and down, Llama's w_q, w_kv and w_out, the head or
the tied embedding's logits). tests/model/test_linear.py fails when a weight matmul bypasses it.

Dtype policy: parameters are stored in fp32 and *weights are cast to the activations' dtype at
use* (`x.dtype`: the compute dtype, `model.dtype`, in which `embed` hands the activations to the
blocks and the blocks keep them); a bias is cast to the output's dtype and added after the
contraction. The pipeline's staggered executor casts a chunk's parameters named with
`CAST_PREFIXES` ahead (pipeline/staggered.py `cast_chunk`: the weights among a chunk's `jax.vjp`
residuals are then the chunk's own arrays, taken from the parameters again instead of carried), which
makes this cast a no-op there. That is the same policy only because the names agree: every weight
and bias a block uses through this seam is named `w_*` / `b_*` and no other block parameter is (norm
scales and biases stay fp32); tests/model/test_linear.py checks both directions.

Why (owner, name) and not the array: the parameter tree must not change (paths such as
`blocks/attn/w_q` are checkpoint keys, Hugging Face name maps, the planner's table and part of the
program digests), so the seam is not a module wrapping the weight (that would add a path level) but
a function the owning module calls with the name of its weight. Whatever a later feature stores
beside the weight on the same owner, `project` finds by that name, and no caller changes:

  LoRA (not implemented): adapters `{name}_lora_a` and `{name}_lora_b` created on the owner next to the
    weight (paths `blocks/attn/w_q_lora_a`: the base model's keys unchanged; the family's parameter
    table lists the new ones). From `letters`, the weight's contracted letters (in the weight, not in
    the output) and its output letters (in both) give a = [contracted..., r] and b = [r, output...]
    with a rank letter r unused by `letters` ('nd,dhk->nhk': a 'dr', b 'rhk'); `project` adds
    `einsum(einsum(x, a), b) * alpha / r` to `y` right after the base einsum, before the bias, both
    adapters through `_weight` (their `w_` prefix has the pipeline cast them ahead too). Freezing the
    base weights is the optimizer's mask.
  fp8 (not implemented): `_weight`'s cast becomes a scaled cast to float8 (e4m3) with a per-weight
    scale stored on the owner, x is cast with its own scale, the einsum gets `preferred_element_type`
    (fp32, or `preferred` where given) and `y` is multiplied by the two scales and cast to the
    compute dtype. The scales stay fp32, so their names stay outside `CAST_PREFIXES` (`scale_w_q`,
    `x_scale_w_q`); delayed scaling's amax histories are state beside the weight too, in a variable
    type of their own so the optimizer leaves them alone.

Formulation: `jnp.einsum` with the caller's letters. For a plain [n, d] x [d, f] matmul,
`einsum('nd,df->nf')` traces to the same dot_general as `x @ w`, so the families' `@` moved here
without a program change (benchmarks/program_digests.py: identical digests).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfrontier import mesh as mesh_lib

# Names of the block parameters this seam uses in the compute dtype: weights (`w_*`) and biases
# (`b_*`). The pipeline casts a chunk's parameters so named ahead (pipeline/staggered.py, `cast_ahead`).
CAST_PREFIXES = ('w_', 'b_')
# Weights the seam multiplies in fp32 whatever the compute dtype (their caller passes fp32 activations):
# the mixture-of-experts router (model/layers/moe.py). Not cast ahead.
FP32_WEIGHTS = ('w_router',)


def cast_ahead(name: str) -> bool:
    """Whether block parameter `name` is one the seam uses in the compute dtype (the pipeline may cast it ahead)."""
    return name.startswith(CAST_PREFIXES) and name not in FP32_WEIGHTS


def project(owner: nnx.Module, name: str, letters: str, x: jax.Array, *, bias: str | None = None,
            out_names: Sequence[str | None] | None = None, preferred: jnp.dtype | None = None) -> jax.Array:
    """`einsum(letters, x, owner.<name>)` with the weight in x's dtype, then bias and sharding.

    Args:
      owner: the module holding the weight (and, later, its adapters or scales).
      name: the weight's attribute on `owner` (`'w_q'`).
      letters: the einsum of activations and weight, `'nd,dhk->nhk'`.
      x: the activations, in the compute dtype.
      bias: the name of a bias on `owner` added to the output (`add_bias`), or None.
      out_names: logical axis names to constrain the output to (mesh.constrain), or None.
      preferred: the einsum's preferred element type (the head's fp32 logits), or None for x's dtype.

    Returns:
      The projection, in `preferred` or x's dtype.
    """
    y = jnp.einsum(letters, x, _weight(owner, name, x.dtype), preferred_element_type=preferred)
    if bias is not None:
        y = add_bias(owner, bias, y)
    return y if out_names is None else mesh_lib.constrain(y, out_names)


def project_grouped(owner, name: str, x_md: jax.Array, group_sizes_g: jax.Array, *,
                    preferred: jnp.dtype | None = None) -> jax.Array:
    """The grouped matmul of a mixture-of-experts layer: rows x_md [M, in] sorted by group, row block g
    (group_sizes_g[g] rows) times weight g of `owner.<name>` [G, in, out] (`jax.lax.ragged_dot`), the
    weight in x's dtype as `project`'s; rows past the groups' total come out 0. [M, out].

    `owner` holds the weight by name as `project`'s does (the MoE layer's weights as one device holds
    them: model/layers/moe.py); LoRA or fp8 on experts would go here as in `project`.
    """
    return jax.lax.ragged_dot(x_md, _weight(owner, name, x_md.dtype), group_sizes_g, preferred_element_type=preferred)


def add_bias(owner: nnx.Module, name: str, y: jax.Array) -> jax.Array:
    """`y` + the bias `owner.<name>` cast to y's dtype (the dtype policy's half for biases).

    `project(bias=...)` calls it; a caller adds a bias itself only to keep an existing program's
    operation order (Llama's q and kv biases come after both projections).
    """
    return y + getattr(owner, name)[...].astype(y.dtype)


def _weight(owner: nnx.Module, name: str, dtype: jnp.dtype) -> jax.Array:
    """The weight as the matmul uses it: cast to the activations' dtype (fp8's scaled cast would go here)."""
    return getattr(owner, name)[...].astype(dtype)
