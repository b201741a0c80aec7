"""Scale layout of a quantized tensor: scale shapes, axes, blocks.

Private to `odmlq.qarray` (whose module docstring states the convention):
``scale`` has the tensor's rank, size 1 on every axis it does not vary along,
``shape[a]`` on each scale axis ``a``, and ``shape[a] // block_size`` on the
block axis. Blockwise math reshapes the tensor into blocks (`to_blocks`) so the
scale broadcasts over each block without being repeated in memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from odmlq.errors import GranularityError

__all__ = ["scale_shape", "normalize_layout", "fit_shape", "to_blocks", "param_to_blocks", "blocked_axis"]

Layout = tuple[tuple[int, ...], int | None, int | None]


def scale_shape(
    shape: Sequence[int],
    scale_axes: Sequence[int] = (),
    block_axis: int | None = None,
    block_size: int | None = None,
) -> tuple[int, ...]:
    """The shape of the scale (and zero point) for a tensor of `shape`.

    Example:
      >>> scale_shape((64, 128), scale_axes=(1,), block_axis=0, block_size=32)
      (2, 128)
    """
    shape = tuple(int(d) for d in shape)
    axes, block_axis, block_size = normalize_layout(shape, scale_axes, block_axis, block_size)
    out = [shape[i] if i in axes else 1 for i in range(len(shape))]
    if block_axis is not None:
        out[block_axis] = shape[block_axis] // block_size
    return tuple(out)


def normalize_layout(
    shape: Sequence[int], scale_axes: Sequence[int], block_axis: int | None, block_size: int | None
) -> Layout:
    """Validated ``(sorted non-negative scale_axes, block_axis, block_size)``."""
    ndim = len(shape)

    def axis(value, name):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or not -ndim <= value < ndim:
            raise GranularityError(
                f"{name}={value!r} is not an axis of a tensor of shape {tuple(shape)}; "
                f"use an int in [{-ndim}, {ndim})."
            )
        return int(value) % ndim

    axes = tuple(sorted(axis(a, "scale_axes entry") for a in scale_axes))
    if len(set(axes)) != len(axes):
        raise GranularityError(f"scale_axes={tuple(scale_axes)} repeats an axis; list each axis once.")
    if (block_axis is None) != (block_size is None):
        raise GranularityError(
            f"block_axis={block_axis!r} and block_size={block_size!r} go together; give both or neither."
        )
    if block_axis is None:
        return axes, None, None
    block_axis = axis(block_axis, "block_axis")
    if isinstance(block_size, bool) or not isinstance(block_size, int | np.integer) or block_size < 1:
        raise GranularityError(f"block_size={block_size!r} must be a positive int, e.g. 32.")
    if block_axis in axes:
        raise GranularityError(
            f"block_axis {block_axis} is also in scale_axes {axes}; blocks already give that axis "
            "one scale per block, so drop it from scale_axes."
        )
    size = shape[block_axis]
    if size % block_size:
        raise GranularityError(
            f"block_size {block_size} does not divide axis {block_axis} of size {size} "
            f"(shape {tuple(shape)}); use a divisor of {size} such as {_nearby_divisors(size, block_size)}."
        )
    return axes, block_axis, int(block_size)


def _nearby_divisors(n: int, target: int) -> str:
    """The divisors of `n` next to `target`, to suggest in an error."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    below = max(d for d in divisors if d <= target)
    above = [d for d in divisors if d > target]
    return f"{below} or {above[0]}" if above else str(below)


def fit_shape(param: jax.Array, target: tuple[int, ...], name: str, layout: Layout) -> jax.Array:
    """`param` in the `target` scale shape; a single value is accepted for per-tensor."""
    if param.shape == target:
        return param
    if param.size == 1 and all(d == 1 for d in target):
        return param.reshape(target)
    axes, block_axis, block_size = layout
    raise GranularityError(
        f"{name} has shape {param.shape}, but scale_axes={axes}, block_axis={block_axis}, "
        f"block_size={block_size} need shape {target}: size 1 on every axis it does not "
        "vary along (keepdims); see odmlq.qarray.scale_shape."
    )


def to_blocks(x: jax.Array, block_axis: int | None, block_size: int | None) -> jax.Array:
    """`x` with `block_axis` split into ``(number of blocks, block_size)``."""
    if block_axis is None:
        return x
    shape = x.shape
    split = (shape[block_axis] // block_size, block_size)
    return x.reshape(shape[:block_axis] + split + shape[block_axis + 1 :])


def param_to_blocks(param: jax.Array, block_axis: int | None) -> jax.Array:
    """A scale or zero point made to broadcast against `to_blocks` of its tensor."""
    return param if block_axis is None else jnp.expand_dims(param, block_axis + 1)


def blocked_axis(axis: int, block_axis: int | None) -> int:
    """Where `axis` lands after `to_blocks` splits `block_axis` in two."""
    return axis + 1 if block_axis is not None and axis > block_axis else axis
