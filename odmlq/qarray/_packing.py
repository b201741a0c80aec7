"""Packing of sub-byte quantized values into uint8 bytes.

Layout (the same for every packed qtype): the logical tensor is flattened in C
(row-major) order, padded with zeros to a multiple of ``values_per_byte``, and
each group of ``values_per_byte`` consecutive values fills one byte **low bits
first**: value ``i`` of a group occupies bits ``[i * bits, (i + 1) * bits)``.
Signed integers are stored as their two's-complement low bits and sign-extended
on unpacking; nf4 stores its level index (0..15) unsigned.

For int4 the first value is the low nibble, the order in which LiteRT packs
int4 tensor buffers (``tflite::PackInt4ValuesDensely``).

Types with ``values_per_byte == 1`` (int3/5/6/7 in int8, int8, int16, fp8) are
passed through unchanged: `pack` only casts them to their storage dtype.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from odmlq.errors import QTypeError
from odmlq.qtypes import QType, qtype as _lookup

__all__ = ["pack", "unpack", "packed_size"]


def packed_size(num_values: int, qtype: str | QType) -> int:
    """Number of stored elements (bytes when packed) for `num_values` values.

    Example:
      >>> packed_size(5, 'int4')
      3
    """
    per_byte = _lookup(qtype).values_per_byte
    return -(-num_values // per_byte)


def pack(values: jax.Array | np.ndarray, qtype: str | QType) -> jax.Array:
    """Packs quantized values into their storage form.

    Args:
      values: integer codes (int2/int4: in [qmin, qmax]; nf4: level indices in
        [0, 15]) of any shape. Bits above the qtype's width are dropped, so
        out-of-range codes are not detected here; `quantize` never makes them.
      qtype: the quantized type, by name or as a `QType`.

    Returns:
      A 1-D uint8 array of ``ceil(size / values_per_byte)`` bytes for packed
      types; otherwise ``values`` cast to the storage dtype, shape unchanged.

    Example:
      >>> pack(np.array([1, -1, 3], np.int8), 'int4')   # 0xF1, 0x03
      Array([241,   3], dtype=uint8)
    """
    qt = _lookup(qtype)
    values = jnp.asarray(values)
    if qt.values_per_byte == 1:
        return values.astype(qt.storage_dtype)
    return _pack(values, qt.name)


# Jitted (keyed by the qtype's name, which is hashable and cheap to compare) so
# that an eager call is one dispatch, not one per primitive.
@functools.partial(jax.jit, static_argnames=("name",))
def _pack(values: jax.Array, name: str) -> jax.Array:
    qt = _lookup(name)
    per_byte = qt.values_per_byte
    flat = values.reshape(-1)
    pad = packed_size(flat.size, qt) * per_byte - flat.size
    # Work in uint8: the two's-complement low bits of a signed code are what is
    # stored, and masking a uint8 gives exactly them.
    flat = jnp.pad(flat.astype(jnp.int8).astype(jnp.uint8), (0, pad))
    groups = flat.reshape(-1, per_byte) & jnp.uint8((1 << qt.bits) - 1)
    shifts = jnp.arange(per_byte, dtype=jnp.uint8) * jnp.uint8(qt.bits)
    # The shifted fields do not overlap, so a sum is a bitwise or.
    return jnp.sum(groups << shifts, axis=1, dtype=jnp.uint8)


def unpack(packed: jax.Array | np.ndarray, qtype: str | QType, shape: Sequence[int]) -> jax.Array:
    """Inverse of `pack`: the values in `shape`, in the qtype's storage dtype.

    Args:
      packed: what `pack` returned.
      qtype: the quantized type the bytes were packed with.
      shape: the logical shape of the values.

    Returns:
      int8 codes (sign-extended) for int2/int4, uint8 indices for nf4, or the
      unpacked input reshaped to `shape` for types that are not packed.

    Example:
      >>> unpack(pack(np.array([1, -1, 3], np.int8), 'int4'), 'int4', (3,))
      Array([ 1, -1,  3], dtype=int8)
    """
    qt = _lookup(qtype)
    shape = tuple(int(d) for d in shape)
    packed = jnp.asarray(packed)
    size = math.prod(shape)
    if qt.values_per_byte == 1:
        if packed.size != size:
            raise QTypeError(
                f"{qt.name} values of shape {shape} need {size} stored values, got {packed.size}."
            )
    elif packed.dtype != jnp.uint8 or packed.size != packed_size(size, qt):
        raise QTypeError(
            f"{qt.name} values of shape {shape} need {packed_size(size, qt)} packed uint8 "
            f"bytes, got {packed.size} of {packed.dtype}; pass what pack() returned."
        )
    if qt.values_per_byte == 1:
        return packed.reshape(shape).astype(qt.storage_dtype)
    return _unpack(packed, qt.name, shape)


@functools.partial(jax.jit, static_argnames=("name", "shape"))
def _unpack(packed: jax.Array, name: str, shape: tuple[int, ...]) -> jax.Array:
    qt = _lookup(name)
    per_byte = qt.values_per_byte
    shifts = jnp.arange(per_byte, dtype=jnp.uint8) * jnp.uint8(qt.bits)
    fields = (packed.reshape(-1, 1) >> shifts) & jnp.uint8((1 << qt.bits) - 1)
    fields = fields.reshape(-1)[: math.prod(shape)]
    if qt.kind == "lut":
        return fields.reshape(shape)
    # Sign-extend: shift the field to the top of a byte, then arithmetic-shift back.
    top = jnp.int8(8 - qt.bits)
    signed = (fields << top.astype(jnp.uint8)).astype(jnp.int8) >> top
    return signed.reshape(shape)
