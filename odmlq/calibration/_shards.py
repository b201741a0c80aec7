"""Ranges of whole tensors (weights), and statistics of a tensor split over devices, read one shard at a time.

A weight sharded over a mesh (`jax.sharding.NamedSharding`) is observed part
by part: each distinct shard is brought to the host alone, observed, and the
parts are put back together, merged where they share channels (the shard
split a reduced axis) and laid side by side where they hold other channels
(the shard split a kept axis). Counts, minima, maxima, extremes and
histograms come out exactly as `observe` of the whole tensor gives them;
sums up to float64 rounding. No device ever holds the whole tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from odmlq.calibration._statistics import Statistics, compute_range, observe, one_batch
from odmlq.calibration._wrapped import CalibrationMethod
from odmlq.errors import CalibrationError
from odmlq.qarray import to_blocks
from odmlq.qtypes import QType
from odmlq.sharding import is_sharded, shard_extents

__all__ = ["observe_shards", "range_of"]

# Statistics fields laid out along the kept axes (then, for top/bottom, the extremes).
_PER_CHANNEL = ("min", "max", "sum", "sum_of_squares", "moving_min", "moving_max", "top", "bottom")

Extent = tuple[tuple[int, int], ...]


def observe_shards(method, x, *, keep_axes: Sequence[int] = (),
                   block: tuple[int, int] | None = None) -> Statistics:
    """`observe(method, None, x, keep_axes=...)` of a sharded `x`, one shard at a time.

    Args:
      method: the calibration method.
      x: a `jax.Array` sharded over devices.
      keep_axes: axes kept per channel, as `observe` takes them, in the
        blocked layout when `block` is given.
      block: ``(axis, size)``: observe ``x`` with `axis` split into (blocks,
        size), the block index kept where `keep_axes` names it (blockwise
        weight scales).

    Raises:
      CalibrationError: a shard boundary that cuts a block (shard the tensor
        along whole blocks), or as `observe`.
    """
    groups: dict[Extent, list[Statistics]] = {}
    full = None
    for extent, shard in shard_extents(x, "A sharded tensor").items():
        values = np.asarray(shard.data)
        if block is not None:
            values, extent = _blocked(values, extent, block, x.shape)
        full = extent if full is None else tuple((min(a[0], b[0]), max(a[1], b[1])) for a, b in zip(full, extent))
        kept = tuple(extent[axis] for axis in keep_axes)
        groups.setdefault(kept, []).append(observe(method, None, values, keep_axes=keep_axes))
    joined = {kept: one_batch(method, parts) for kept, parts in groups.items()}
    if len(joined) == 1:
        return next(iter(joined.values()))
    shape = tuple(full[axis][1] - full[axis][0] for axis in keep_axes)
    return _laid_out(joined, shape)


def _blocked(values: np.ndarray, extent: Extent, block: tuple[int, int], shape) -> tuple[np.ndarray, Extent]:
    axis, size = block
    start, stop = extent[axis]
    if start % size or stop % size:
        raise CalibrationError(
            f"A shard of a tensor of shape {tuple(shape)} holds elements {start}..{stop} of axis {axis}, "
            f"which cuts its blocks of {size}; shard that axis in whole blocks (a multiple of "
            f"{size} per device) or shard another axis.")
    values = to_blocks(values, axis, size)
    extent = extent[:axis] + ((start // size, stop // size), (0, size)) + extent[axis + 1:]
    return values, extent


def _laid_out(groups: dict[tuple, Statistics], shape: tuple[int, ...]) -> Statistics:
    """One Statistics whose per-channel fields hold each group's channels in place."""
    first = next(iter(groups.values()))
    fields = {}
    for name in _PER_CHANNEL:
        if getattr(first, name) is None:
            fields[name] = None
            continue
        sample = np.asarray(getattr(first, name))
        out = np.zeros(shape + sample.shape[len(shape):], sample.dtype)
        for kept, stats in groups.items():
            out[tuple(slice(a, b) for a, b in kept)] = getattr(stats, name)
        fields[name] = out
    return dataclasses.replace(first, **fields)


def range_of(
    method: CalibrationMethod | dict[str, Any] | str,
    x: Any,
    qtype: QType | str,
    *,
    symmetric: bool,
    keep_axes: Sequence[int] = (),
    block: tuple[int, int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One-shot range of a whole tensor (weights): observe, then compute_range.

    A `jax.Array` sharded over devices is observed one shard at a time
    (`observe_shards`), with the same result.

    Args:
      block: ``(axis, size)``: `x`'s `axis` split into (blocks, size) first;
        `keep_axes` then count axes of that blocked layout.

    Example:
      >>> from odmlq.calibration import AbsMax
      >>> w = np.array([[1.0, -2.0], [0.5, 0.25]])
      >>> range_of(AbsMax(), w, 'int8', symmetric=True, keep_axes=(0,))[1]
      array([2. , 0.5], dtype=float32)
    """
    if is_sharded(x):
        stats = observe_shards(method, x, keep_axes=keep_axes, block=block)
    else:
        if block is not None:
            x = to_blocks(np.asarray(x), *block)
        stats = observe(method, None, x, keep_axes=keep_axes)
    return compute_range(method, stats, qtype, symmetric=symmetric)
