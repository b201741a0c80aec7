"""Parameter paths: the names plans give weights ('conv1/kernel', 'layers/0/kernel')."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

__all__ = ["flat_params", "param_path", "params_tree", "replace_params"]


def param_path(path) -> str:
    """A pytree key path as the plan names it: Linen's 'params' collection and
    NNX's '.value' are dropped, keys joined with '/'."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            parts.append(str(key.key))
        else:
            parts.append(str(key))
    if parts and parts[-1] == "value":  # nnx.Variable leaves
        parts = parts[:-1]
    if len(parts) > 1 and parts[0] == "params":  # Linen's params collection
        parts = parts[1:]
    return "/".join(parts)


def params_tree(params: Any) -> Any:
    """The params pytree of Linen variables, NNX state or an NNX module.

    An NNX module's random state (`nnx.Rngs` held as an attribute, a
    Dropout's stream) is left out: it is no weight, and a PRNG key is not an
    array odmlq can quantize or serialize (`split_nnx`)."""
    nnx = loaded_nnx()
    if nnx is None:  # no NNX object can exist
        return params
    if isinstance(params, nnx.Module):
        return split_nnx(params)[2]
    if isinstance(params, nnx.State):
        return nnx.filter_state(params, nnx.Not(nnx.RngState))
    return params


def loaded_nnx():
    """`flax.nnx` when something has imported it, else None. An NNX module or
    state exists only once it is imported, and a Linen user need not pay for
    importing it (about 30 MB and a second, with what it pulls in)."""
    return sys.modules.get("flax.nnx")


def is_nnx_module(model: Any) -> bool:
    nnx = loaded_nnx()
    return nnx is not None and isinstance(model, nnx.Module)


def split_nnx(model: Any) -> tuple[Any, Any, Any]:
    """``(graphdef, random state, the rest)`` of an NNX module."""
    from flax import nnx

    return nnx.split(model, nnx.RngState, ...)


def merge_nnx(graphdef: Any, random_state: Any, state: Any) -> Any:
    """The module of `split_nnx`'s parts, for a call inside a trace. The random
    state is closed over, not traced, so its variables are made afresh here:
    NNX's own transforms (``nnx.scan`` over stacked layers) refuse a variable
    made at an outer trace level ("Cannot extract graph node from different
    trace level")."""
    from flax import nnx

    return nnx.merge(graphdef, jax.tree.map(lambda leaf: leaf, random_state), state)


def flat_params(params: Any) -> dict[str, Any]:
    """Parameter path ('conv1/kernel') -> array, the paths plans use."""
    leaves = jax.tree_util.tree_flatten_with_path(params_tree(params))[0]
    return {param_path(path): leaf for path, leaf in leaves}


def replace_params(params: Any, new: Mapping[str, Any]) -> Any:
    """`params` with the leaves named in `new` replaced."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(params_tree(params))
    out = [new.get(param_path(path), leaf) for path, leaf in leaves]
    return jax.tree_util.tree_unflatten(tree, out)


def check_finite_params(params: Any) -> None:
    """Raises CalibrationError naming each parameter with NaN or Inf values."""
    from odmlq.errors import CalibrationError

    bad = []
    for path, value in flat_params(params).items():
        x = np.asarray(value)
        if np.issubdtype(x.dtype, np.floating) and not np.all(np.isfinite(x)):
            bad.append(f"{path!r} ({int(x.size - np.count_nonzero(np.isfinite(x)))} of {x.size})")
    if bad:
        raise CalibrationError(
            f"Parameters with NaN or Inf values: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; "
            "no scale can be computed from them. Check the checkpoint or the training run that made them.")
