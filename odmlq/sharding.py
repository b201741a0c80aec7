"""Sharding: how odmlq reads arrays split over a mesh of devices, and lays out what it makes of them.

JAX does the distributed work (`jax.sharding`, `jax.jit` with shardings);
odmlq only keeps what it is given where it is. A quantized weight keeps its
float weight's mesh axes: the integer values are split like the float
values, and the scales (and zero points) along the axes they vary along,
replicated along the axes they reduce. Sub-byte values are packed flat
(`odmlq.qarray`), so their bytes are split evenly along the flat order.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from odmlq.errors import PlanError

__all__ = ["is_sharded", "shard_extents", "mesh_axes_size", "scale_sharding", "packed_sharding", "placed",
           "quantized_placement"]

Extent = tuple[tuple[int, int], ...]  # (start, stop) along each axis


def is_sharded(x: Any) -> bool:
    """True for a concrete `jax.Array` split over more than one device."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return False
    sharding = x.sharding
    return len(sharding.device_set) > 1 and not sharding.is_fully_replicated


def shard_extents(x: jax.Array, what: str) -> dict[Extent, Any]:
    """Each distinct part of `x` (replicas once): (start, stop) per axis -> a shard holding it.

    Raises:
      PlanError: `x` (`what`) is not fully addressable: another process holds
        parts of it.
    """
    if not x.is_fully_addressable:
        raise PlanError(
            f"{what} (shape {x.shape}) is sharded over devices of other processes; odmlq reads every "
            "shard of it from this process: run with one process per mesh, or gather it first.")
    parts: dict[Extent, Any] = {}
    for shard in x.addressable_shards:
        extent = tuple(index.indices(size)[:2] for index, size in zip(shard.index, x.shape))
        parts.setdefault(extent, shard)
    return parts


def named(x: jax.Array, what: str) -> NamedSharding:
    """`x`'s sharding as a `NamedSharding`.

    Raises:
      PlanError: another kind of sharding, which names no mesh axes.
    """
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding):
        raise PlanError(
            f"{what} is sharded with a {type(sharding).__name__}; odmlq keeps shardings that name mesh "
            "axes: place it with jax.sharding.NamedSharding(mesh, PartitionSpec(...)).")
    return sharding


def _spec(sharding: NamedSharding, ndim: int) -> tuple:
    spec = tuple(sharding.spec)
    return spec + (None,) * (ndim - len(spec))


def mesh_axes_size(mesh, axes) -> int:
    """Devices along one PartitionSpec entry (None, a mesh axis name, or a tuple of them)."""
    if axes is None:
        return 1
    names = axes if isinstance(axes, tuple) else (axes,)
    return math.prod(mesh.shape[n] for n in names)


def scale_sharding(sharding: NamedSharding, scale_shape: tuple[int, ...]) -> NamedSharding:
    """A scale's (or zero point's) sharding for a weight placed with `sharding`.

    Along each axis the scale keeps the weight's mesh axes where it has
    several entries that split evenly over them (channels, blocks), and is
    replicated where it has one (a reduced axis) or would split unevenly.
    """
    spec = _spec(sharding, len(scale_shape))
    kept = tuple(axes if n > 1 and n % mesh_axes_size(sharding.mesh, axes) == 0 else None
                 for axes, n in zip(spec, scale_shape))
    return NamedSharding(sharding.mesh, PartitionSpec(*kept))


def quantized_placement(sharding: NamedSharding, shape: tuple[int, ...], stored: tuple[int, ...],
                        scale_shape: tuple[int, ...]) -> tuple[NamedSharding, NamedSharding]:
    """``(values, scales)``: where the parts of a QArray of a tensor of `shape`
    placed with `sharding` go. Its values are stored as `stored` (the tensor's
    shape, or the flat bytes of packed sub-byte values); its scales (and zero
    points) have `scale_shape`."""
    stored = tuple(stored)
    values = sharding if stored == tuple(shape) else packed_sharding(sharding, len(shape), stored[0])
    return values, scale_sharding(sharding, tuple(scale_shape))


def packed_sharding(sharding: NamedSharding, ndim: int, stored: int) -> NamedSharding:
    """Packed (flat) bytes of a weight placed with `sharding`: split over all
    its mesh axes in flat order when they divide the bytes evenly, else
    replicated. For a weight split along its first axis only, each device's
    bytes are exactly its rows."""
    used = tuple(name for axes in _spec(sharding, ndim) if axes is not None
                 for name in (axes if isinstance(axes, tuple) else (axes,)))
    if not used or stored % mesh_axes_size(sharding.mesh, used) != 0:
        return NamedSharding(sharding.mesh, PartitionSpec())
    return NamedSharding(sharding.mesh, PartitionSpec(used if len(used) > 1 else used[0]))


def placed(fun, out: NamedSharding):
    """`fun` under `jax.jit`, its one output placed with `out`.

    On a mesh with explicit axes (`jax.make_mesh`'s default), the body runs
    with those axes automatic (`jax.sharding.auto_axes`), so reshapes that
    mix sharded axes (packing sub-byte values) are partitioned by XLA
    instead of refused. Keep the result to call it again: each new one
    compiles anew."""
    mesh = out.mesh
    if not any(t == AxisType.Explicit for t in mesh.axis_types):
        return jax.jit(fun, out_shardings=out)
    jitted = jax.jit(jax.sharding.auto_axes(fun, out_sharding=out.spec))

    def run(*args):
        with jax.set_mesh(mesh):
            return jitted(*args)
    return run
