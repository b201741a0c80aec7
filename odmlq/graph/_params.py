"""Parameter paths: the names plans give weights ('conv1/kernel', 'layers/0/kernel')."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator, Mapping
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


# Marks a name scope opened for an NNX submodule's call (`nnx_call_scopes`);
# its path follows, joined by "." (an attribute name or a list index has none).
NNX_SCOPE = "nnx:"


@contextlib.contextmanager
def nnx_call_scopes(module: Any) -> Iterator[None]:
    """While it is open, each submodule of the NNX `module` calls in a
    ``jax.named_scope`` naming its path (``nnx:blocks.0.attention``), so that
    a traced op is named after the module that computes it, as Linen names
    its calls (NNX opens no scope: a norm's statistics were named after the
    module whose output they read). Submodules made inside a transform
    (``nnx.scan`` over stacked layers) are other objects and open none."""
    from flax import nnx

    paths: dict[int, str] = {}
    classes: set[type] = set()
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Module) and path and id(node) not in paths:
            paths[id(node)] = ".".join(str(p) for p in path)
            owner = next((c for c in type(node).__mro__ if "__call__" in vars(c)), None)
            if owner is not None and owner is not object:
                classes.add(owner)
    open_scopes: list[int] = []

    def scoped(call):
        @functools.wraps(call)
        def wrapper(self, *args, **kwargs):
            path = paths.get(id(self))
            if path is None or (open_scopes and open_scopes[-1] == id(self)):  # super().__call__
                return call(self, *args, **kwargs)
            open_scopes.append(id(self))
            try:
                with jax.named_scope(NNX_SCOPE + path):
                    return call(self, *args, **kwargs)
            finally:
                open_scopes.pop()
        return wrapper

    originals = {cls: vars(cls)["__call__"] for cls in classes}
    try:
        for cls, call in originals.items():
            cls.__call__ = scoped(call)
        yield
    finally:
        for cls, call in originals.items():
            cls.__call__ = call


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
