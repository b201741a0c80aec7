"""Data-parallel calibration: a batch sharded over devices, each device running its part.

A batch whose arrays are split along their first (batch) axis over several
devices (`jax.device_put(x, NamedSharding(mesh, PartitionSpec('data')))`) is
calibrated part by part: each distinct part runs on a device that holds it,
with the params that device holds (replicated params) or a copy placed there
once (host params), and the parts' statistics are merged as one batch
(`Calibration.observe_parts`). Anything else (a batch on one device, params
split over the mesh) runs as one computation where its arrays lie.
"""

from __future__ import annotations

from typing import Any

import jax

from odmlq.sharding import is_sharded, shard_extents

__all__ = ["device_parts"]


def device_parts(inputs: tuple, params: Any, placed: dict) -> list[tuple[Any, tuple]] | None:
    """``[(params on device, the inputs' part on it)]``, one per distinct part
    of the batch in batch order; None when the batch is not split along its
    first axis alone, the inputs are split differently, or the params are
    split over devices. `placed` caches each device's params across batches."""
    if not inputs or not all(is_sharded(x) for x in inputs):
        return None
    layouts = []
    for x in inputs:
        extents = shard_extents(x, "A calibration batch")
        if any(extent[1:] != tuple((0, n) for n in x.shape[1:]) for extent in extents):
            return None
        layouts.append({extent[0]: shard for extent, shard in extents.items()})
    rows = sorted(layouts[0])
    if any(sorted(layout) != rows for layout in layouts[1:]):
        return None
    parts = []
    for row in rows:
        device = layouts[0][row].device
        shards = [layout[row] for layout in layouts]
        if any(shard.device != device for shard in shards):
            return None
        here = _params_on(params, device, placed)
        if here is None:
            return None
        parts.append((here, tuple(shard.data for shard in shards)))
    return parts


def _params_on(params: Any, device, placed: dict) -> Any | None:
    """The params as `device` holds them (None if some are split over devices)."""
    if device in placed:
        return placed[device]

    def local(leaf):
        if isinstance(leaf, jax.Array) and len(leaf.sharding.device_set) > 1:
            if not leaf.sharding.is_fully_replicated:
                raise _Split
            return next(s.data for s in leaf.addressable_shards if s.device == device)
        return jax.device_put(leaf, device)

    try:
        placed[device] = jax.tree_util.tree_map(local, params)
    except _Split:
        placed[device] = None
    return placed[device]


class _Split(Exception):
    """A parameter split over devices: no device holds all the params."""
