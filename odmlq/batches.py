"""A representative batch read as model inputs.

A batch is one model input, or a tuple (or list) of them, one per positional
argument. An input is an array, or a pytree of arrays (a dict of
`input_ids` and `attention_mask`, as a tokenizer returns), every leaf with
the batch dimension first, except a scalar (0-d) leaf, which every row shares
(the ``cache_index`` of a Flax ``decode=True`` cache). A batch whose arrays
have no common leading size (a graph's nodes and edges) is one example,
taken whole (`taken_whole`). A .tflite takes the
leaves, in `jax.tree` order, as its inputs; `leaf_names` names them after
their keys.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["leaf_names", "leaves", "model_inputs", "row_count", "sliced", "taken_whole"]


def model_inputs(batch: Any) -> tuple:
    """The batch's model inputs: the tuple of them, or a one-input batch in one."""
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def leaves(tree: Any) -> list[np.ndarray]:
    """The arrays of `tree` (model inputs, or a model's outputs) as numpy
    arrays, in `jax.tree` order: the order a .tflite takes or writes them."""
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def row_count(inputs: Sequence[Any]) -> int:
    """The batch size: the leading dimension of the first array that has one
    (1 for a batch taken whole: `taken_whole`)."""
    sizes = _leading_sizes(inputs)
    if not sizes:
        return 0
    return 1 if len(set(sizes)) > 1 else int(sizes[0])


def taken_whole(inputs: Sequence[Any]) -> bool:
    """Whether a batch's arrays have leading dimensions of different sizes, so
    that no batch dimension runs through them (a graph network's nodes, edges
    and per-graph counts: a jraph ``GraphsTuple``). Such a batch is one
    example: calibrated, exported (at `example_inputs`' shapes) and verified
    whole, never cut into rows."""
    return len(set(_leading_sizes(inputs))) > 1


def _leading_sizes(inputs: Sequence[Any]) -> list[int]:
    """The leading size of every array of `inputs` with one (read from shapes: no copy)."""
    return [np.shape(x)[0] for x in jax.tree_util.tree_leaves(tuple(inputs)) if np.ndim(x)]


def sliced(inputs: Sequence[Any], start: int, stop: int | None) -> tuple:
    """Rows `start` to `stop` of every array of `inputs`, as numpy arrays (a scalar,
    which every row shares, as it is); a batch taken whole (`taken_whole`) whole."""
    if taken_whole(inputs):
        return tuple(jax.tree_util.tree_map(np.asarray, tuple(inputs)))
    return tuple(jax.tree_util.tree_map(lambda x: np.asarray(x)[start:stop] if np.ndim(x) else np.asarray(x),
                                        tuple(inputs)))


def leaf_names(inputs: Sequence[Any], arg_names: Sequence[str]) -> list[str]:
    """A name per array of `inputs`: the argument's name for an array input;
    for a pytree input, the keys leading to the array (``attention_mask``;
    ``batch_mask`` after the argument's name where the model takes several
    inputs). Made unique with a numeric suffix where two coincide."""
    names: list[str] = []
    for arg, value in zip(arg_names, inputs):
        paths = jax.tree_util.tree_flatten_with_path(value)[0]
        for path, _ in paths:
            keys = [_key(k) for k in path]
            if not keys:
                names.append(arg)
            else:
                names.append("_".join([arg, *keys] if len(inputs) > 1 else keys))
    unique: list[str] = []
    for name in names:
        name = candidate = re.sub(r"[^0-9A-Za-z_]", "_", name) or "input"
        count = 0
        while candidate in unique:
            count += 1
            candidate = f"{name}_{count}"
        unique.append(candidate)
    return unique


def _key(entry) -> str:
    for attribute in ("key", "idx", "name"):
        if hasattr(entry, attribute):
            return str(getattr(entry, attribute))
    return str(entry)
