"""How a checkpoint's arrays are read onto another mesh or layout (restore onto any mesh).

Restoring builds every array directly in the target's shardings (`ArrayRestoreArgs(sharding=...)`),
so a checkpoint written on one mesh is read onto any other: each process reads only the slices
its devices hold. `plan_restore` says how to read each array (and refuses what cannot be
converted), `finish_restore` reshapes those saved in another layer split.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxfrontier.errors import CheckpointError
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.checkpoint import format as format_lib


def layer_split(name: str, saved: tuple[int, ...], target: tuple[int, ...]) -> tuple[int, int] | None:
    """(saved, target) numbers of leading layer dimensions when a block array differs only in them.

    Interleaved pipelines store block arrays [V, L / V, ...] instead of [L, ...], in the same
    layer order (params_lib.split_virtual), so the two convert by a reshape.
    """
    if not (name.startswith('blocks/') or '/blocks/' in name):
        return None
    for k_saved, k_target in ((1, 2), (2, 1), (2, 2)):
        if (saved[k_saved:] == target[k_target:] and len(saved) > k_saved and len(target) > k_target
                and math.prod(saved[:k_saved]) == math.prod(target[:k_target]) and saved != target):
            return k_saved, k_target
    return None


def _layer_split_sharding(leaf: jax.ShapeDtypeStruct, saved: tuple[int, ...], ks: int, kt: int) -> NamedSharding:
    """Where to restore a block array in its saved [L, ...] or [V, L / V, ...] shape before the reshape:
    the target's sharding of the other dimensions, and its layer sharding on the last layer dimension."""
    mesh, spec = leaf.sharding.mesh, tuple(leaf.sharding.spec) + (None,) * len(leaf.shape)
    axes = tuple(a for e in spec[:kt] for a in mesh_lib.entry_axes(e))
    layer = [None] * ks
    if axes and saved[ks - 1] % math.prod(mesh.shape[a] for a in axes) == 0:
        layer[-1] = axes[0] if len(axes) == 1 else axes
    return NamedSharding(mesh, P(*layer, *spec[kt:len(leaf.shape)]))


def plan_restore(target: Any, saved_shapes: dict[str, tuple[int, ...]], vocab: tuple[int, int],
                 where: str) -> tuple[Any, Any, dict[str, jax.ShapeDtypeStruct]]:
    """How to read each array of `target` from a checkpoint whose arrays have `saved_shapes`.

    Two differences are resolved, every other one is an error naming the array:
      vocabulary padding  the padded vocabulary depends on mesh.tensor (config_lib.padded_vocab);
                          padding rows are never read by the model (token ids < vocab_size,
                          padded logits masked), so they are dropped or zero-filled.
      ZeRO-1 padding      optimizer state padded to a multiple of the data-parallel size
                          (layout_lib.zero1_layout); the padding is zero: dropped or zero-filled.
      layer split         interleaved pipelines hold block arrays as [V, L / V, ...]: such an
                          array is read in its saved shape, then reshaped (`finish_restore`).

    Args:
      target: the abstract tree to restore (ShapeDtypeStructs with shardings).
      saved_shapes: '/'-joined leaf path -> shape, from the checkpoint's metadata.
      vocab: (saved padded vocabulary, target padded vocabulary).
      where: the checkpoint, for messages.

    Returns:
      (item, restore_args, {name: target leaf} of the arrays finish_restore must reshape).
    """
    reshaped: dict[str, jax.ShapeDtypeStruct] = {}

    def one(path, leaf):
        name = format_lib.path_name(path)
        if name not in saved_shapes:
            raise CheckpointError(
                f'checkpoint {where} has no array {name!r}: it was written by a different '
                'model or version. Fix: start from a checkpoint of this model, or use a new '
                '--workdir.')
        saved = tuple(saved_shapes[name])
        split = layer_split(name, saved, leaf.shape)
        if split:
            reshaped[name] = leaf
            sharding = _layer_split_sharding(leaf, saved, *split)
            return (jax.ShapeDtypeStruct(saved, leaf.dtype, sharding=sharding),
                    ocp.ArrayRestoreArgs(sharding=sharding, global_shape=saved, dtype=leaf.dtype))
        # ZeRO-1 pads optimizer state that no data-parallel size divides (layout_lib.zero1_layout);
        # its padding is always zero, so it too is dropped or zero-filled.
        zero1_padding = name.startswith('opt_state/')
        padded_only = len(saved) == len(leaf.shape) and all(
            s == t or (s, t) == vocab or zero1_padding for s, t in zip(saved, leaf.shape))
        if saved != leaf.shape and not padded_only:
            raise CheckpointError(
                f'checkpoint {where}: array {name!r} has shape {saved}, the config needs '
                f'{leaf.shape}. Fix: use the config the checkpoint was written with.')
        return leaf, ocp.ArrayRestoreArgs(sharding=leaf.sharding, global_shape=leaf.shape, dtype=leaf.dtype,
                                          strict=saved == leaf.shape)

    pairs = jax.tree_util.tree_map_with_path(one, target)
    is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], ocp.ArrayRestoreArgs)  # noqa: E731
    return (jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair), jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair),
            reshaped)


def finish_restore(restored: Any, reshaped: dict[str, jax.ShapeDtypeStruct]) -> Any:
    """Reshapes the arrays plan_restore read in another layer split into their target layout, one at a time."""

    def one(path, x):
        leaf = reshaped.get(format_lib.path_name(path))
        return x if leaf is None else _reshaper(leaf.shape, leaf.sharding)(x)

    return jax.tree_util.tree_map_with_path(one, restored) if reshaped else restored


@functools.lru_cache(maxsize=None)
def _reshaper(shape: tuple[int, ...], sharding: NamedSharding):
    """One compiled reshape per (shape, sharding): a parameter and its two Adam moments share it."""
    return jax.jit(lambda a: a.reshape(shape), out_shardings=sharding, donate_argnums=0)


def saved_shapes_of(tree_metadata: Any) -> dict[str, tuple[int, ...]]:
    tree = getattr(tree_metadata, 'tree', tree_metadata)
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, 'shape'))[0]
    return {format_lib.path_name(path): tuple(leaf.shape) for path, leaf in flat}
