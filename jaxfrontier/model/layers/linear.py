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

  LoRA (families/lora.py, model/lora.py): `adapt(owner, name, lora, rngs)` creates adapters `{name}_lora_a`
    and `{name}_lora_b` on the owner next to the weight when `lora` targets it (paths `blocks/attn/w_q_lora_a`:
    the base model's keys unchanged; the planner's table adds them, families/lora.py `adapter_specs`). The
    weight's contracted dimensions (the target's `contracted` leading ones) and its output ones give
    a = [contracted..., r] (uniform in +-1/sqrt(fan-in), PEFT's default) and b = [r, output...] (zeros, so a
    fresh adapter leaves the model as it was), with the weight's logical names (they shard as it does; the
    rank dimension whole). `project` adds `einsum(einsum(dropout(x), a), b) * alpha / r` to `y` right after
    the base einsum, before the bias, both adapters through `_weight` (their `w_` prefix has the pipeline cast
    them ahead too). A fused weight whose slices are targeted apart (w_kv's k and v) has one pair stacked over
    its targeted slices only (a [d, S, r], b [S, r, G, K]); their products fill those slices of the fused
    output, the others get nothing. Freezing the base is the train step's (training/state.py: the base is not
    among the parameters it differentiates). Dropout on the adapter's input takes the key the module passes
    (its block's, folded with the weight's name), in training only.
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

import contextlib
import contextvars
import dataclasses
import math
import zlib
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfrontier import mesh as mesh_lib
from jaxfrontier.families import Lora
from jaxfrontier.model.layers.base import dropout, param

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
            out_names: Sequence[str | None] | None = None, preferred: jnp.dtype | None = None,
            key: jax.Array | None = None) -> jax.Array:
    """`einsum(letters, x, owner.<name>)` with the weight in x's dtype, then bias and sharding.

    Args:
      owner: the module holding the weight (and, later, its adapters or scales).
      name: the weight's attribute on `owner` (`'w_q'`).
      letters: the einsum of activations and weight, `'nd,dhk->nhk'`.
      x: the activations, in the compute dtype.
      bias: the name of a bias on `owner` added to the output (`add_bias`), or None.
      out_names: logical axis names to constrain the output to (mesh.constrain), or None.
      preferred: the einsum's preferred element type (the head's fp32 logits), or None for x's dtype.
      key: the dropout key of a LoRA adapter's input (training), or None.

    Returns:
      The projection, in `preferred` or x's dtype.
    """
    y = jnp.einsum(letters, x, _weight(owner, name, x.dtype), preferred_element_type=preferred)
    use = getattr(owner, name + ADAPTED, None)
    if use is not None and _ADAPTERS_ON.get():  # a LoRA adapter (static: the module was built with it)
        y = y + _adapter(owner, name, letters, x, use, key).astype(y.dtype)
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


# --------------------------------------------------------------------------- LoRA

ADAPTED = '_lora'  # the owner's static record of an adapted weight: `<name>_lora` (`Adapted`)
RANK_LETTERS = 'rzyxwvutsqponmlkjihgfedcba'  # the first one a matmul's letters leave free names the rank


_ADAPTERS_ON = contextvars.ContextVar('lora_adapters_on', default=True)


@contextlib.contextmanager
def adapters_off() -> Iterator[None]:
    """Within it, `project` skips every LoRA adapter: a model built with adapters computes its base model
    (DPO's reference model under LoRA: the same bound module and params, no second copy of the base).

    Read when a matmul is traced, not part of `jax.jit`'s cache key: enter it inside the function that
    is traced (`def reference(params, x): with adapters_off(): return model_def.bind(params)(x)`), not
    around a call of a function jitted elsewhere too. The adapters it skips get no gradient."""
    token = _ADAPTERS_ON.set(False)
    try:
        yield
    finally:
        _ADAPTERS_ON.reset(token)


# The precision of an adapter's (x a) b: DEFAULT, as every matmul's, but spelled out (the same HLO) so that a
# remat policy can tell that product apart (`without_adapter_products`).
ADAPTER_PRECISION = jax.lax.Precision.DEFAULT


def without_adapter_products(policy):
    """Remat `policy` (None: save nothing) that never saves an adapter's (x a) b: a policy saving dots
    (save_dots) would keep it beside its base matmul's output, as large: Llama 8B on Frontier's layout took
    48 % more memory per device (XLA) than full fine-tuning. The backward recomputes it from the saved
    x a ([tokens, r]) and b: r / in of the base matmul's work. Without adapters, `policy`'s choices."""
    if policy is None:
        return None
    tagged = (ADAPTER_PRECISION, ADAPTER_PRECISION)

    def saveable(prim, *avals, **params):
        if prim is jax.lax.dot_general_p and params.get('precision') == tagged:
            return False
        return policy(prim, *avals, **params)

    return saveable


@dataclasses.dataclass(frozen=True)
class Adapted:
    """How `project` applies weight `<name>`'s adapters: contracted dimensions, the targeted slices of a
    fused weight (None: one module) and its fused axis' size, alpha / r, the input's dropout rate."""

    contracted: int
    slices: tuple[int, ...] | None
    fused: int
    scale: float
    dropout: float


def adapt(owner: nnx.Module, name: str, lora: Lora | None, rngs: nnx.Rngs) -> None:
    """Creates weight `name`'s adapters on `owner` where `lora` (the targets under the owner, `Lora.under`)
    targets it; nothing otherwise (the module and its program as without LoRA)."""
    if lora is None or name not in lora.weights():
        return
    t, slices, w = lora.weights()[name], lora.slices(name), getattr(owner, name)
    dims, names, c, r = tuple(w.shape), tuple(w.get_metadata()['out_sharding']), t.contracted, lora.rank
    fused, fused_names = ((), ()) if slices is None else ((len(slices),), (names[c],))
    rest = c + len(fused)
    bound = math.prod(dims[:c]) ** -0.5  # PEFT's kaiming_uniform(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    a = jax.random.uniform(rngs.params(), (*dims[:c], *fused, r), jnp.float32, -bound, bound)
    setattr(owner, name + '_lora_a', nnx.Param(a, out_sharding=(*names[:c], *fused_names, None), eager_sharding=False))
    setattr(owner, name + '_lora_b', param(None, (*fused, r, *dims[rest:]), (*fused_names, None, *names[rest:]), 0.0))
    setattr(owner, name + ADAPTED, Adapted(t.contracted, slices, dims[c] if slices else 0, lora.scale, lora.dropout))


def _adapter(owner: nnx.Module, name: str, letters: str, x: jax.Array, use: Adapted,
             key: jax.Array | None) -> jax.Array:
    """alpha / r x (x a) b of weight `name`, shaped like its einsum's output (module docstring)."""
    lhs, out = letters.split('->')
    xs, ws = lhs.split(',')
    con, rest = ws[:use.contracted], ws[use.contracted:]
    r = next(letter for letter in RANK_LETTERS if letter not in letters)
    kept = ''.join(letter for letter in xs if letter not in con)
    fused = rest[0] if use.slices is not None else ''
    a, b = _weight(owner, name + '_lora_a', x.dtype), _weight(owner, name + '_lora_b', x.dtype)
    drop_key = None if key is None else jax.random.fold_in(key, zlib.crc32(name.encode()))

    t = jnp.einsum(f'{xs},{con}{fused}{r}->{kept}{fused}{r}', dropout(x, use.dropout, drop_key), a)
    d = jnp.einsum(f'{kept}{fused}{r},{fused}{r}{rest[len(fused):]}->{out}', t, b,
                   precision=ADAPTER_PRECISION) * jnp.asarray(use.scale, x.dtype)
    if use.slices is None or use.slices == tuple(range(use.fused)):
        return d
    axis = out.index(fused)  # an untargeted slice of the fused output gets nothing
    zero = jnp.zeros_like(jnp.take(d, 0, axis=axis))
    return jnp.stack([jnp.take(d, use.slices.index(i), axis=axis) if i in use.slices else zero
                      for i in range(use.fused)], axis=axis)
