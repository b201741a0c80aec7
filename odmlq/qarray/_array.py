"""Quantized arrays: quantize, dequantize, fake-quantize, and the scales they use.

Conventions (every odmlq backend relies on them):

- **Scale shape.** ``scale`` has the rank of the logical tensor, with size 1
  on every axis it does not vary along (keepdims), so it broadcasts against
  the tensor. Per-tensor: all ones. ``scale_axes=(a,)``: ``shape[a]`` on axis
  ``a``. Blockwise (``block_axis=a, block_size=b``): ``shape[a] // b`` on axis
  ``a``; block ``k`` covers elements ``[k*b, (k+1)*b)`` of that axis. To apply
  it the tensor is reshaped into blocks (axis ``a`` split into ``(shape[a]//b,
  b)``) and the scale broadcast over the inner axis, which equals repeating
  each scale ``b`` times along ``a``. ``zero_point`` has the scale's shape.
  `scale_shape` computes it.
- **Integers:** ``q = clip(round_half_to_even(x / scale) + zero_point, qmin,
  qmax)``, computed in float32 (``x`` is cast to float32 first); with
  ``narrow_range`` the most negative code is never produced. Dequantizing is
  ``(q - zero_point) * scale`` in float32. A symmetric QArray has
  ``zero_point=None``.
- **fp8:** ``(x / scale)`` clipped to the format's finite range (saturating:
  large values become ±max, never NaN or inf), then rounded to nearest even by
  the cast to float8.
- **nf4:** the index of the `NF4_LEVELS` entry nearest to ``x / scale``; a
  value exactly on the float32 midpoint of two levels takes the lower index.
  Dequantizing gives exactly ``NF4_LEVELS[index] * scale``.
- **Storage.** int2/int4/nf4 are packed into uint8 (see `pack`: C order, low
  bits first). int3/5/6/7 use one int8 each, int16 int16, fp8 float8.
- **Zero range.** Where a range is all zero (or so small that the scale
  underflows float32) `compute_scale` returns scale 1.0, a valid finite
  non-zero scale; every value then quantizes exactly to the zero point.

Static things (qtype, shapes, axes, block size, narrow_range) are plain Python
values; arrays may be jax arrays, tracers under `jax.jit`, or numpy arrays.
Checks that need values (finite ranges, positive scales) run only when the
values are concrete, i.e. not under `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from odmlq.qarray import _kernels as kernels
from odmlq.qarray._packing import pack, unpack
from odmlq.qarray._sharded import quantize_and_pack_sharded
from odmlq.qarray._layout import fit_shape, normalize_layout, scale_shape
from odmlq.errors import CalibrationError, GranularityError, QTypeError
from odmlq.qtypes import QType, qtype as _lookup
from odmlq.sharding import is_sharded

__all__ = [
    "QArray", "quantize", "quantize_tensor", "fake_quant", "compute_scale",
    "reduce_range", "scale_shape", "pack", "unpack",
]

@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["qvalue", "scale", "zero_point"],
    meta_fields=["qtype", "shape", "scale_axes", "block_axis", "block_size", "narrow_range"],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class QArray:
    """A quantized tensor: stored values, scale, optional zero point, layout.

    Build one with `quantize` or `quantize_tensor`. A QArray is a pytree whose
    leaves are ``qvalue``, ``scale`` and ``zero_point``; the rest is static,
    so it passes through `jax.jit` and `jax.tree.map`. Do not `jax.vmap` over
    one: ``shape`` is static and would not see the batch axis.

    Attributes:
      qvalue: stored values: int8/int16 codes, float8 values, or (int2, int4,
        nf4) packed uint8 bytes, 1-D. Use `values()` for the logical view.
      scale: float32, see the module docstring for its shape.
      zero_point: int32 of the scale's shape, or None (symmetric).
      qtype: the `QType` (given by its canonical name, e.g. ``'int8'``, or as one).
      shape: the logical shape.
      scale_axes: sorted non-negative axes the scale varies along.
      block_axis: the axis split into blocks of ``block_size``, or None.
      block_size: elements per block along ``block_axis``, or None.
      narrow_range: whether the most negative integer code is excluded.
    """

    qvalue: jax.Array
    scale: jax.Array
    zero_point: jax.Array | None = None
    qtype: QType
    shape: tuple[int, ...]
    scale_axes: tuple[int, ...] = ()
    block_axis: int | None = None
    block_size: int | None = None
    narrow_range: bool = False

    def __post_init__(self):
        # Only static fields are checked: jax rebuilds QArrays with arbitrary
        # leaves (tracers, sentinels) while transforming them, and on every
        # call of a jitted function that returns one (a KV cache): the check
        # of a layout seen before is looked up, not redone.
        if not isinstance(self.shape, tuple):
            raise GranularityError(f"QArray.shape must be a tuple of ints, got {self.shape!r}.")
        try:
            key = (self.qtype, self.shape, self.scale_axes, self.block_axis, self.block_size, self.narrow_range)
            hash(key)
        except TypeError:  # an unhashable field: checked (and refused) without the cache
            key = None
        qt = _checked_static(*key) if key is not None else _checked_static.__wrapped__(
            self.qtype, self.shape, self.scale_axes, self.block_axis, self.block_size, self.narrow_range)
        object.__setattr__(self, "qtype", qt)

    @property
    def qtype_info(self) -> QType:
        """The `QType` (range, bits, storage): ``qtype`` itself."""
        return self.qtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def symmetric(self) -> bool:
        return self.zero_point is None

    @property
    def nbytes(self) -> int:
        """Bytes actually stored: qvalue + scale + zero_point (if any)."""
        leaves = [self.qvalue, self.scale] + ([] if self.zero_point is None else [self.zero_point])
        # From shape and dtype so that it also works on tracers.
        return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in leaves)

    def values(self) -> jax.Array:
        """The stored values in the logical shape, unpacked.

        int codes (int8, or int16 for int16), float8 values for fp8, uint8
        level indices for nf4.
        """
        return unpack(self.qvalue, self.qtype, self.shape)

    def dequantize(self, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """The float tensor this QArray represents (computed in float32).

        Example:
          >>> q = quantize_tensor(np.array([0.5, -1.0]), 'int8')
          >>> q.dequantize()
          Array([ 0.503937, -1.      ], dtype=float32)
        """
        return kernels.dequantize_stored(
            self.qvalue, self.scale, self.zero_point, kernels.kernel_for(self.qtype_info), self.block_axis,
            self.block_size, self.shape, np.dtype(dtype),
        )

    def __repr__(self) -> str:
        parts = [self.qtype.name, f"shape={self.shape}"]
        if self.scale_axes:
            parts.append(f"scale_axes={self.scale_axes}")
        if self.block_axis is not None:
            parts.append(f"block_axis={self.block_axis}, block_size={self.block_size}")
        parts.append("symmetric" if self.symmetric else "asymmetric")
        if self.narrow_range:
            parts.append("narrow_range")
        return f"QArray({', '.join(parts)})"


def reduce_range(
    x: jax.Array | np.ndarray,
    *,
    scale_axes: Sequence[int] = (),
    block_axis: int | None = None,
    block_size: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Min and max of `x` over every axis but `scale_axes`, per block.

    Returns:
      ``(lo, hi)``, float32, each in the scale shape (see `scale_shape`).

    Raises:
      GranularityError: bad axes or blocks (see `quantize`).
      CalibrationError: some scale would cover no values (an empty tensor).

    Example:
      >>> lo, hi = reduce_range(np.array([[1., -2.], [3., 4.]]), scale_axes=(0,))
      >>> lo.ravel(), hi.ravel()
      (Array([-2.,  3.], dtype=float32), Array([1., 4.], dtype=float32))
    """
    x = jnp.asarray(x)
    layout = normalize_layout(x.shape, scale_axes, block_axis, block_size)
    if x.size == 0 and math.prod(scale_shape(x.shape, *layout)) > 0:
        raise CalibrationError(
            f"The range of an empty tensor (shape {x.shape}) is undefined; give each scale at "
            "least one value, or pass the range to compute_scale yourself."
        )
    return kernels.reduce_range(x, layout)


def compute_scale(
    lo: jax.Array | np.ndarray,
    hi: jax.Array | np.ndarray,
    qtype: str | QType,
    *,
    symmetric: bool,
    narrow_range: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """Scale (and zero point) that represent the float range ``[lo, hi]``.

    Symmetric: ``scale = max(|lo|, |hi|) / qmax`` (qmax = 127 for int8 with or
    without narrow range; the fp8 maximum for fp8; 1 for nf4), no zero point.
    Asymmetric (integer qtypes only): the range is first widened to include 0
    so that 0.0 is exactly representable, then ``scale = (hi - lo) / (qmax -
    qmin)`` over the (narrow) integer range and ``zero_point =
    round_half_to_even(qmin - lo / scale)`` clipped to ``[qmin, qmax]``.
    Where the scale would be 0 (a zero range) it is 1.0.

    Args:
      lo, hi: float ranges, each of the scale's shape (see `reduce_range`).
      qtype: the quantized type.
      symmetric: whether to omit the zero point.
      narrow_range: drop the most negative integer code (integer qtypes only).

    Returns:
      ``(scale, zero_point)``: float32 scale, int32 zero point or None.

    Raises:
      CalibrationError: `lo`/`hi` are not finite, or ``lo > hi`` somewhere.
      QTypeError: asymmetric or narrow range asked of fp8 or nf4.

    Example:
      >>> compute_scale(np.float32(-1.0), np.float32(3.0), 'int8', symmetric=False)
      (Array(0.01568628, dtype=float32), Array(-64, dtype=int32))
    """
    qt = _lookup(qtype)
    lo, hi = jnp.asarray(lo), jnp.asarray(hi)
    _check_narrow_range(qt, narrow_range)
    if not symmetric and not qt.is_integer:
        raise QTypeError(
            f"{qt.name} has no zero point, so it cannot be asymmetric; use symmetric=True "
            "or an integer qtype such as 'int8'."
        )
    if _concrete(lo, hi):
        _check_range(*np.broadcast_arrays(np.asarray(lo, np.float32), np.asarray(hi, np.float32)))
    return kernels.scale_from_range(lo, hi, kernels.qrange(qt, narrow_range), symmetric)


def quantize(
    x: jax.Array | np.ndarray,
    qtype: str | QType,
    *,
    scale: jax.Array | np.ndarray | float,
    zero_point: jax.Array | np.ndarray | int | None = None,
    scale_axes: Sequence[int] = (),
    block_axis: int | None = None,
    block_size: int | None = None,
    narrow_range: bool = False,
) -> QArray:
    """Quantizes `x` with the given scale (and zero point); see the module doc.

    Args:
      x: the float tensor; computed on in float32.
      qtype: the quantized type.
      scale: positive float scale of shape ``scale_shape(x.shape, ...)``
        (a scalar is accepted for per-tensor). Cast to float32.
      zero_point: integer zero point of the scale's shape, or None
        (symmetric). Integer qtypes only. Cast to int32.
      scale_axes: axes the scale varies along; negative axes count from the end.
      block_axis, block_size: one scale per `block_size` elements of `block_axis`.
      narrow_range: never produce the most negative code (integer qtypes only).

    Raises:
      GranularityError: bad axes, a block size that does not divide its axis,
        or a scale/zero point of the wrong shape.
      QTypeError: a zero point or narrow range with fp8/nf4.
      CalibrationError: a scale that is not finite and positive (when concrete).

    Example:
      >>> q = quantize(np.array([0.2, -0.3]), 'int8', scale=0.1)
      >>> q.values()
      Array([ 2, -3], dtype=int8)
    """
    qt, x, scale, zero_point, (axes, block_axis, block_size) = _validate(
        x, qtype, scale, zero_point, scale_axes, block_axis, block_size, narrow_range
    )
    bounds, kernel = kernels.qrange(qt, narrow_range), kernels.kernel_for(qt)
    if is_sharded(x):  # computed where it lies, placed like x (odmlq.sharding)
        qvalue, scale, zero_point = quantize_and_pack_sharded(x, scale, zero_point, qt, bounds, kernel,
                                                              block_axis, block_size)
    else:
        qvalue = kernels.quantize_and_pack(x, scale, zero_point, bounds, kernel, block_axis, block_size)
    return QArray(
        qvalue=qvalue, scale=scale, zero_point=zero_point, qtype=qt.name,
        shape=tuple(x.shape), scale_axes=axes, block_axis=block_axis,
        block_size=block_size, narrow_range=narrow_range,
    )


def quantize_tensor(
    x: jax.Array | np.ndarray,
    qtype: str | QType,
    *,
    scale_axes: Sequence[int] = (),
    block_axis: int | None = None,
    block_size: int | None = None,
    symmetric: bool = True,
    narrow_range: bool = False,
) -> QArray:
    """Quantizes `x` with a scale from its own min/max (abs-max if symmetric).

    Example:
      >>> quantize_tensor(np.ones((4, 8)), 'int4', scale_axes=(0,), narrow_range=True)
      QArray(int4, shape=(4, 8), scale_axes=(0,), symmetric, narrow_range)
    """
    lo, hi = reduce_range(x, scale_axes=scale_axes, block_axis=block_axis, block_size=block_size)
    scale, zero_point = compute_scale(lo, hi, qtype, symmetric=symmetric, narrow_range=narrow_range)
    return quantize(
        x, qtype, scale=scale, zero_point=zero_point, scale_axes=scale_axes,
        block_axis=block_axis, block_size=block_size, narrow_range=narrow_range,
    )


def fake_quant(
    x: jax.Array | np.ndarray,
    qtype: str | QType,
    *,
    scale: jax.Array | np.ndarray | float,
    zero_point: jax.Array | np.ndarray | int | None = None,
    scale_axes: Sequence[int] = (),
    block_axis: int | None = None,
    block_size: int | None = None,
    narrow_range: bool = False,
) -> jax.Array:
    """``quantize(x, ...).dequantize()`` in `x`'s float dtype, without packing.

    Computed in float32 and cast back to `x`'s dtype (float32 for non-float
    input). Arguments as for `quantize`. Its gradient is zero almost
    everywhere (rounding); it is the reference semantics, not a training op.

    Example:
      >>> fake_quant(np.array([0.26, -0.3], np.float32), 'int8', scale=0.1)
      Array([ 0.3, -0.3], dtype=float32)
    """
    dtype = float_dtype(x)
    qt, x, scale, zero_point, (_, block_axis, block_size) = _validate(
        x, qtype, scale, zero_point, scale_axes, block_axis, block_size, narrow_range
    )
    bounds, kernel = kernels.qrange(qt, narrow_range), kernels.kernel_for(qt)
    return kernels.fake_quant(x, scale, zero_point, bounds, kernel, block_axis, block_size, dtype)


# --- private -----------------------------------------------------------------


def _validate(x, qtype, scale, zero_point, scale_axes, block_axis, block_size, narrow_range):
    """``(qtype, x, scale, zero_point, layout)``, checked and in canonical form."""
    qt = _lookup(qtype)
    x = jnp.asarray(x)
    layout = normalize_layout(x.shape, scale_axes, block_axis, block_size)
    scale, zero_point = _check_parameters(qt, x.shape, layout, scale, zero_point, narrow_range)
    return qt, x, scale, zero_point, layout


def _check_parameters(qt, shape, layout, scale, zero_point, narrow_range):
    """Validated float32 scale and int32 zero point (or None), in the scale shape."""
    _check_narrow_range(qt, narrow_range)
    target = scale_shape(shape, *layout)
    scale = fit_shape(jnp.asarray(scale, jnp.float32), target, "scale", layout)
    if _concrete(scale):
        host = np.asarray(scale)
        valid = (host > 0) & np.isfinite(host)
        if not valid.all():
            raise CalibrationError(
                f"scale must be finite and positive, got {host[~valid][:4].tolist()}; compute it "
                "with compute_scale, which maps a zero range to 1.0."
            )
    if zero_point is None:
        return scale, None
    if not qt.is_integer:
        raise QTypeError(f"{qt.name} has no zero point; pass zero_point=None (symmetric).")
    return scale, fit_shape(jnp.asarray(zero_point), target, "zero_point", layout).astype(jnp.int32)


@functools.lru_cache(maxsize=4096)
def _checked_static(qtype, shape, scale_axes, block_axis, block_size, narrow_range) -> QType:
    """The QType of a QArray's static fields, once they are checked."""
    qt = _lookup(qtype)
    if isinstance(qtype, str) and qt.name != qtype:
        raise QTypeError(f"QArray.qtype must be a canonical name; use {qt.name!r}, not {qtype!r}.")
    layout = normalize_layout(shape, scale_axes, block_axis, block_size)
    if layout != (scale_axes, block_axis, block_size):
        raise GranularityError(
            f"QArray layout must be normalized (sorted non-negative axes); use "
            f"scale_axes={layout[0]}, block_axis={layout[1]}."
        )
    _check_narrow_range(qt, narrow_range)
    return qt


def _check_narrow_range(qt: QType, narrow_range: bool) -> None:
    if narrow_range and not qt.is_integer:
        raise QTypeError(
            f"narrow_range is for integer qtypes; {qt.name} has no integer codes, so pass narrow_range=False."
        )


def _check_range(lo: np.ndarray, hi: np.ndarray) -> None:
    for name, value in (("lo", lo), ("hi", hi)):
        if not np.all(np.isfinite(value)):
            raise CalibrationError(
                f"The range to quantize is not finite: {name} has {value[~np.isfinite(value)][:4].tolist()}. "
                "Check the calibration data for NaN/inf (an empty range also gives ±inf)."
            )
    if np.any(lo > hi):
        raise CalibrationError(
            f"The range to quantize has lo > hi (e.g. lo={lo[lo > hi][0]}, hi={hi[lo > hi][0]}); "
            "pass lo = min and hi = max."
        )


def float_dtype(x) -> np.dtype:
    """The float dtype `fake_quant` returns `x` in: its own, float32 for non-float input."""
    dtype = np.dtype(getattr(x, "dtype", np.float32))
    # float64 numpy input comes back as float32 unless jax_enable_x64 is on.
    if not jnp.issubdtype(dtype, jnp.floating):
        return np.dtype(np.float32)
    return jax.dtypes.canonicalize_dtype(dtype)


def _concrete(*arrays) -> bool:
    return not any(isinstance(a, jax.core.Tracer) for a in arrays)
