"""The array math behind `odmlq.qarray`, whose docstring states the semantics.

Private. The public functions validate, then call these. The entry points
are jitted so that an eager call (quantizing a checkpoint weight by weight)
dispatches one fused computation, not one per primitive; under an outer jit
they are inlined. They are keyed by `Kernel`, not by the qtype, and take the
qtype's range as an argument, so that int3..int8 (all stored in int8) share
compiled code.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from odmlq.qarray._packing import pack, unpack
from odmlq.qarray._layout import blocked_axis, param_to_blocks, scale_shape, to_blocks
from odmlq.qtypes import NF4_LEVELS, QType

# Blocks `block_sums_in_order` adds per pass of its loop.
_UNROLLED_BLOCKS = 16
# Decision points of nf4 rounding: a value above midpoint k goes to level k+1.
_NF4_MIDPOINTS = (NF4_LEVELS[:-1] + NF4_LEVELS[1:]) / np.float32(2)


class Kernel(NamedTuple):
    """What compiled code depends on (a static argument of every kernel)."""

    kind: str  # 'int', 'float' or 'lut'
    storage: str  # numpy dtype name of one unpacked value
    packed_as: str | None  # the qtype name for packed types, else None


def kernel_for(qt: QType) -> Kernel:
    """The kernel of a qtype; every int width stored in int8 gets the same one."""
    return Kernel(qt.kind, np.dtype(qt.storage_dtype).name, qt.name if qt.values_per_byte > 1 else None)


def qrange(qt: QType, narrow_range: bool) -> np.ndarray:
    """``[qmin, qmax]`` as float32, passed to kernels as a (traced) argument."""
    return np.array(qt.range(narrow_range), np.float32)


_STATIC = ("kernel", "block_axis", "block_size")


@functools.partial(jax.jit, static_argnames=_STATIC)
def quantize_and_pack(x, scale, zero_point, bounds, kernel, block_axis, block_size):
    """What `QArray.qvalue` stores for `x`."""
    values = quantize_values(x, scale, zero_point, bounds, kernel, block_axis, block_size)
    return values if kernel.packed_as is None else pack(values, kernel.packed_as)


@functools.partial(jax.jit, static_argnames=_STATIC + ("dtype",))
def fake_quant(x, scale, zero_point, bounds, kernel, block_axis, block_size, dtype):
    """Quantize then dequantize, skipping the packing in between."""
    values = quantize_values(x, scale, zero_point, bounds, kernel, block_axis, block_size)
    return dequantize_values(values, scale, zero_point, kernel, block_axis, block_size).astype(dtype)


@functools.partial(jax.jit, static_argnames=_STATIC + ("shape", "dtype"))
def dequantize_stored(qvalue, scale, zero_point, kernel, block_axis, block_size, shape, dtype):
    """The float tensor of a QArray's stored leaves."""
    if kernel.packed_as is None:
        values = qvalue.reshape(shape)
    else:
        values = unpack(qvalue, kernel.packed_as, shape)
    return dequantize_values(values, scale, zero_point, kernel, block_axis, block_size).astype(dtype)


@functools.partial(jax.jit, static_argnames=("layout",))
def reduce_range(x, layout):
    """float32 ``(min, max)`` of `x` in the scale shape of a normalized layout."""
    axes, block_axis, block_size = layout
    blocks = to_blocks(x.astype(jnp.float32), block_axis, block_size)
    keep = {blocked_axis(a, block_axis) for a in axes} | ({block_axis} - {None})
    reduce = tuple(i for i in range(blocks.ndim) if i not in keep)
    target = scale_shape(x.shape, *layout)
    lo = jnp.min(blocks, axis=reduce, keepdims=True).reshape(target)
    hi = jnp.max(blocks, axis=reduce, keepdims=True).reshape(target)
    return lo, hi


@functools.partial(jax.jit, static_argnames=("symmetric",))
def scale_from_range(lo, hi, bounds, symmetric):
    """``(scale, zero_point or None)``; see `odmlq.qarray.compute_scale`."""
    lo, hi = jnp.broadcast_arrays(lo.astype(jnp.float32), hi.astype(jnp.float32))
    qmin, qmax = bounds[0], bounds[1]
    if symmetric:
        # qmax does not change with narrow_range, so neither does this scale.
        return nonzero_scale(jnp.maximum(jnp.abs(lo), jnp.abs(hi)) / qmax), None
    lo, hi = jnp.minimum(lo, 0.0), jnp.maximum(hi, 0.0)
    scale = nonzero_scale((hi - lo) / (qmax - qmin))
    zero_point = jnp.clip(jnp.round(qmin - lo / scale), qmin, qmax).astype(jnp.int32)
    return scale, zero_point


def dynamic_asymmetric(x, lo, hi, bounds):
    """``(codes, scale, zero_point)`` of `x` on the asymmetric integer grid of its
    run-time range ``[lo, hi]`` (keepdims-shaped), computed as XNNPACK's
    dynamic-range (qd8) kernels compute it, so that the codes are the ones
    LiteRT multiplies: the range widened to hold 0; ``inv = (qmax - qmin) /
    (hi - lo)`` in float32 (1 for a zero range); the zero point from whichever
    end rounds less, clipped and rounded half to even; ``codes = round(x * inv)
    + zero_point``, clipped; and ``scale = 1 / inv``. Dividing by ``(hi - lo) /
    (qmax - qmin)`` instead differs in the last bit of some ratios: on the
    sample decoder one input of one matmul came out -14.5 (rounded to -14)
    where XNNPACK's product was -14.500001 (-15), and the logits moved by 1%."""
    qmin, qmax = bounds[0], bounds[1]
    lo, hi = jnp.minimum(lo.astype(jnp.float32), 0.0), jnp.maximum(hi.astype(jnp.float32), 0.0)
    inv = jnp.where(lo == hi, jnp.float32(1.0), (qmax - qmin) / jnp.where(lo == hi, 1.0, hi - lo))
    below, above = lo * inv, hi * inv
    zero_point = jnp.where((qmin + below) + (qmax + above) > 0, qmin - below, qmax - above)
    zero_point = jnp.round(jnp.clip(zero_point, qmin, qmax))
    codes = jnp.clip(jnp.round(x.astype(jnp.float32) * inv) + zero_point, qmin, qmax)
    return codes, jnp.float32(1.0) / inv, zero_point.astype(jnp.int32)


def dynamic_symmetric(x, lo, hi, bounds):
    """``(codes, scale, None)`` of `x` on the symmetric integer grid of its
    run-time range, computed as LiteRT's built-in hybrid kernels compute it
    (``SymmetricQuantizeFloats``): ``range = max(|lo|, |hi|)``, ``codes =
    round(x * (qmax / range))`` with halves away from zero, clipped to
    ``+-qmax``, and ``scale = range / qmax`` (codes 0 and scale 1 for a zero
    range), as the asymmetric grid follows XNNPACK's. Measured on 2048 rows
    of 256 through one built-in hybrid FULLY_CONNECTED: every row equals
    simulate within 2.3e-7 of its largest output, as it did when the codes
    were the input divided by the scale (a value that lands on a tie one way
    and not the other is rarer than that)."""
    qmax = bounds[1]
    limit = jnp.maximum(jnp.abs(lo.astype(jnp.float32)), jnp.abs(hi.astype(jnp.float32)))
    empty = limit == 0
    inv = jnp.where(empty, jnp.float32(0.0), qmax / jnp.where(empty, 1.0, limit))
    y = x.astype(jnp.float32) * inv
    codes = jnp.clip(jnp.sign(y) * jnp.floor(jnp.abs(y) + 0.5), -qmax, qmax)
    return codes, jnp.where(empty, jnp.float32(1.0), limit / qmax), None


def quantize_values(x, scale, zero_point, bounds, kernel, block_axis, block_size):
    """Unpacked codes / fp8 values / nf4 indices of `x` (in float32), shape kept."""
    ratio = to_blocks(x.astype(jnp.float32), block_axis, block_size) / param_to_blocks(scale, block_axis)
    if kernel.kind == "int":
        codes = jnp.round(ratio)
        if zero_point is not None:
            # Adding an integer after rounding equals rounding after adding it.
            codes = codes + param_to_blocks(zero_point, block_axis).astype(jnp.float32)
        out = jnp.clip(codes, bounds[0], bounds[1]).astype(kernel.storage)
    elif kernel.kind == "float":
        # Clip first: the float8 cast of an out-of-range value is NaN (e4m3fn)
        # or inf (e5m2), and saturation is what a quantizer must do.
        out = jnp.clip(ratio, bounds[0], bounds[1]).astype(kernel.storage)
    else:
        # side='left' counts midpoints strictly below the value, so a value on
        # a midpoint takes the lower index.
        out = jnp.searchsorted(jnp.asarray(_NF4_MIDPOINTS), ratio, side="left").astype(jnp.uint8)
    return out.reshape(x.shape)


def dequantize_values(values, scale, zero_point, kernel, block_axis, block_size):
    """float32 tensor from unpacked values."""
    blocks = to_blocks(values, block_axis, block_size)
    if kernel.kind == "lut":
        floats = jnp.asarray(NF4_LEVELS)[blocks.astype(jnp.int32)]
    elif zero_point is not None:
        # The difference is exact in int32 (both operands are small integers).
        floats = (blocks.astype(jnp.int32) - param_to_blocks(zero_point, block_axis)).astype(jnp.float32)
    else:
        floats = blocks.astype(jnp.float32)
    return (floats * param_to_blocks(scale, block_axis)).reshape(values.shape)


def nonzero_scale(scale: jax.Array) -> jax.Array:
    """1.0 where `scale` is 0 (a zero range, or one that underflows float32)."""
    # A zero scale would divide by zero when quantizing, and LiteRT rejects it.
    return jnp.where(scale > 0, scale, jnp.float32(1.0))


def block_sums_in_order(sums: jax.Array, scales: jax.Array, start: jax.Array | None = None) -> jax.Array:
    """``start + sum_i sums[i] * scales[i]``, added one block after another
    from the first, as XNNPACK's blockwise kernels add them; `simulate`
    (`odmlq._sums`) and `odmlq.xla`'s blockwise kernel (`_matmul.dot_int`)
    both add their blocks with it.

    With block scales that bfloat16 holds (as LiteRT plans round them) and
    block sums under 2**16, each product is exact and only the additions
    round, in the same order in simulate and XLA: the two agree bit for bit.
    (One reduction over all blocks added them in an order of XLA's choosing:
    21% of a small decoder's prefill logits differed from XLA's in their
    last bits.) With float32 block scales a product rounds, and where XLA
    fuses a multiply with its add (one rounding) in one program and not in
    the other, the two may differ in the last bit.
    """
    shape = jnp.broadcast_shapes(sums.shape[1:], scales.shape[1:])
    scales = jnp.broadcast_to(scales, scales.shape[:1] + shape)
    start = jnp.zeros(shape, sums.dtype) if start is None else jnp.broadcast_to(start, shape)

    def step(acc, block):
        s, c = block
        return acc + s * c, None

    # Unrolled 16 blocks at a time: XLA fuses them into one pass over the
    # output (a one-block loop ran a prefill's blockwise matmuls 2-10x slower).
    return lax.scan(step, start, (sums, scales), unroll=min(sums.shape[0], _UNROLLED_BLOCKS))[0]
