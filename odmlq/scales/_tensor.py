"""TensorScale: how one tensor is quantized, with numbers, and the scales
made from a float range or a constant's value (internal; `odmlq.scales`)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from odmlq.errors import PlanError
from odmlq.qarray import QArray, compute_scale, fake_quant, quantize
from odmlq.qtypes import QType, qtype as lookup_qtype


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorScale:
    """How one tensor is quantized, with numbers: see `odmlq.qarray` for the shapes."""

    qtype: QType
    scale: np.ndarray
    zero_point: np.ndarray | None = None
    scale_axes: tuple[int, ...] = ()
    block_axis: int | None = None
    block_size: int | None = None
    narrow_range: bool = False
    rounding: str = "half_even"
    # For 'half_away': the output is an integer sum divided by this count; the
    # float value is snapped back onto that grid before rounding, so float32
    # noise cannot move a tie.
    divisor: int = 1

    def __post_init__(self):
        object.__setattr__(self, "qtype", lookup_qtype(self.qtype))

    def _kwargs(self) -> dict:
        return dict(scale=self.scale, zero_point=self.zero_point, scale_axes=self.scale_axes,
                    block_axis=self.block_axis, block_size=self.block_size,
                    narrow_range=self.narrow_range)

    def fake_quant(self, x: jax.Array) -> jax.Array:
        if self.rounding == "half_away" or self.divisor > 1:
            return _fake_quant_of_sum(x, self)
        return fake_quant(x, self.qtype, **self._kwargs())

    def quantize(self, x: jax.Array) -> QArray:
        return quantize(x, self.qtype, **self._kwargs())

    def cells(self, shape) -> np.ndarray | None:
        """Each element's scale cell for a tensor of `shape`: the flat index
        (row-major) of the scale it is quantized with; None where the scale is
        not keepdims-shaped to the tensor."""
        scale = np.asarray(self.scale)
        if scale.ndim != len(shape):
            if scale.size != 1:
                return None
            scale = scale.reshape((1,) * len(shape))
        cell = np.arange(scale.size).reshape(scale.shape)
        if self.block_axis is not None:
            cell = np.repeat(cell, self.block_size, axis=self.block_axis)
        return np.broadcast_to(cell, tuple(shape))

    def lsb(self) -> np.ndarray:
        """One quantization step, in the tensor's float units."""
        return np.asarray(self.scale, np.float32)

    def same_grid(self, other: "TensorScale | None") -> bool:
        """Whether `other` puts values on this grid: one qtype, scale axes,
        scales and zero points (whatever their keepdims shapes)."""
        return (other is not None and other.qtype == self.qtype and other.scale_axes == self.scale_axes
                and np.array_equal(np.ravel(other.scale), np.ravel(self.scale))
                and np.array_equal(np.ravel(0 if other.zero_point is None else other.zero_point),
                                   np.ravel(0 if self.zero_point is None else self.zero_point)))


def tensor_scale(spec, lo, hi, shape) -> TensorScale:
    """The scale (and zero point) of `spec` for the float range [lo, hi]."""
    lo, hi = np.reshape(lo, shape), np.reshape(hi, shape)
    scale, zero_point = compute_scale(lo, hi, spec.qtype, symmetric=spec.symmetric,
                                      narrow_range=spec.narrow_range)
    scale = stored_scale(scale, getattr(spec, "scale_dtype", "float32"))
    return TensorScale(
        qtype=spec.qtype, scale=np.asarray(scale, np.float32),
        zero_point=None if zero_point is None else np.asarray(zero_point, np.int32),
        scale_axes=spec.scale_axes, block_axis=spec.block_axis, block_size=spec.block_size,
        narrow_range=spec.narrow_range)


def stored_scale(scale, dtype: str) -> np.ndarray:
    """`scale` as stored in `dtype` ('float32': unchanged; see `float16_up`, `bfloat16_up`)."""
    if dtype == "float16":
        return float16_up(scale)
    if dtype == "bfloat16":
        return bfloat16_up(scale)
    return scale


def bfloat16_up(scale) -> np.ndarray:
    """Each scale as the nearest value not below it that bfloat16 and float16
    both hold (float32 values): LiteRT stores block scales as float16, and
    XNNPACK's blockwise kernels read them as bfloat16 (measured: a float16
    scale that bfloat16 does not hold put LiteRT's outputs 55 dB from the
    plan's, one both hold 130 dB). Inside float16's range every such value is
    a float16: a bfloat16 has 8 significant bits, and a float16 subnormal
    rounded up to 8 significant bits stays a multiple of its step."""
    half = float16_up(scale)
    brain = half.astype(ml_dtypes.bfloat16)
    low = brain.astype(np.float32) < half
    brain = np.where(low, np.nextafter(brain, ml_dtypes.bfloat16(np.inf)), brain).astype(np.float32)
    if not np.all(np.isfinite(brain.astype(np.float16))):
        raise PlanError(f"A weight scale of {float(np.max(scale)):.3g} is past float16's range (65504), in "
                        "which LiteRT stores block scales; rescale the weight or use per-channel scales.")
    return brain


def float16_up(scale) -> np.ndarray:
    """Each scale as the nearest float16 not below it (float32 values): a
    weight's largest magnitude still fits the grid, as the computed scale
    promised."""
    scale = np.asarray(scale, np.float32)
    half = scale.astype(np.float16)
    low = half.astype(np.float32) < scale
    half = np.where(low, np.nextafter(half, np.float16(np.inf)), half)
    # A block of magnitudes under float16's smallest step rounds to zero codes with it.
    half = np.where((half == 0) & (scale > 0), np.float16(2.0 ** -24), half)
    if not np.all(np.isfinite(half)):
        raise PlanError(f"A weight scale of {float(np.max(scale)):.3g} is past float16's range (65504), in "
                        "which LiteRT stores block scales; rescale the weight or use per-channel scales.")
    return half.astype(np.float32)


def reshaped(ts: TensorScale, ndim: int) -> TensorScale:
    """A per-tensor scale laid out for a tensor of `ndim` dimensions."""
    shape = (1,) * ndim
    return TensorScale(qtype=ts.qtype, scale=np.asarray(ts.scale).reshape(shape),
                       zero_point=None if ts.zero_point is None else np.asarray(ts.zero_point).reshape(shape),
                       narrow_range=ts.narrow_range)


def constant_scale(value: np.ndarray, qtype: str) -> TensorScale:
    """Per-tensor symmetric scale of a constant operand, from its value.

    A constant that a power-of-two scale holds exactly (0, 0.5, 3.0, values on
    a grid of 0.25) gets that scale and no error; any other gets
    ``max|value| / qmax`` (its largest magnitude exact, the rest rounded).

    Raises:
      PlanError: the constant is not finite.
    """
    qt = lookup_qtype(qtype)
    v = np.asarray(value, np.float64)
    shape = (1,) * v.ndim
    if not np.all(np.isfinite(v)):
        raise PlanError(f"A constant operand {v.tolist() if v.size <= 8 else v.shape} is not finite; "
                        "it cannot be quantized. Keep its op in float with a skip rule.")
    absmax = float(np.max(np.abs(v))) if v.size else 0.0
    scale = 1.0
    if absmax > 0:
        scale = 2.0 ** math.ceil(math.log2(absmax / qt.qmax))
        if not np.array_equal(v / scale, np.round(v / scale)):
            scale = float(np.asarray(compute_scale(np.float32(-absmax), np.float32(absmax), qt.name,
                                                   symmetric=True)[0]))
    return TensorScale(qtype=qt.name, scale=np.full(shape, scale, np.float32))


def _fake_quant_of_sum(x: jax.Array, ts: TensorScale) -> jax.Array:
    """Fake-quantizes an average of integers as the target kernel rounds it.

    ``x / scale`` is snapped back onto the grid of 1/`divisor` (float32 noise
    must not move a tie). 'half_away' rounds ``x / scale + zero_point`` half
    away from zero, as LiteRT's AVERAGE_POOL_2D divides its raw integer sum;
    'half_even' rounds ``x / scale`` half to even, then adds the zero point,
    as requantizing kernels (a depthwise convolution) do.
    """
    qt = ts.qtype
    s = jnp.asarray(ts.scale)
    zp = 0.0 if ts.zero_point is None else jnp.asarray(ts.zero_point, jnp.float32)
    v = jnp.round(x / s * ts.divisor) / ts.divisor
    if ts.rounding == "half_away":
        v = v + zp
        q = jnp.sign(v) * jnp.floor(jnp.abs(v) + 0.5)
    else:
        q = jnp.round(v) + zp
    q = jnp.clip(q, qt.qmin, qt.qmax)
    return ((q - zp) * s).astype(x.dtype)
