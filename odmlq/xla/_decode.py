"""Stored quantized values to float32 (or int8 codes), in ways XLA's CPU backend runs fast.

Internal to the XLA kernels. Each function gives exactly the values
`odmlq.qarray` defines (checked against it in tests); they differ from the
obvious jnp expression only in speed, measured on one 4096x4096 weight-only
matmul at batch 1 (bench/README.md):

- float8 -> float32: XLA converts float8 element by element in software
  (7x slower than the float32 matmul); rebuilding the float32 bit pattern from
  sign, exponent and mantissa with integer ops vectorizes (1.04x).
- nf4 indices -> levels: a gather from the 16-entry table is 1.9x the float
  matmul; a tree of 4 selects on the index bits is 1.2x.
- packed int4 / nf4 bytes: interleaving the two nibbles back into one row
  costs 2.6x; each nibble is kept apart instead (`nibbles`) and the matmul run
  on even and odd columns separately (0.5-0.7x).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from odmlq.qtypes import NF4_LEVELS

# (exponent bits, mantissa bits, exponent bias) of the float8 formats.
_FP8 = {"float8_e4m3fn": (4, 3, 7), "float8_e5m2": (5, 2, 15)}


def fp8_to_float32(values: jax.Array) -> jax.Array:
    """float8 values as float32, from their bits.

    Finite values only: quantization saturates, so stored float8 values are
    never NaN or infinite (an e4m3fn NaN would decode as 480).
    """
    name = np.dtype(values.dtype).name
    return fp8_bits_to_float32(lax.bitcast_convert_type(values, jnp.uint8), name)


_FP8_QTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def fp8_bits_to_float32(bits: jax.Array, dtype: str) -> jax.Array:
    """float8 values given as their uint8 bits (bitcast once, outside any loop:
    a bitcast inside the decoding fusion makes XLA convert element by element).

    `dtype` names the format: 'float8_e4m3fn' / 'fp8_e4m3' or 'float8_e5m2' / 'fp8_e5m2'.
    """
    exponent_bits, mantissa_bits, bias = _FP8[_FP8_QTYPES.get(dtype, dtype)]
    bits = bits.astype(jnp.uint32)
    sign = (bits >> (exponent_bits + mantissa_bits)) << 31
    exponent = (bits >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = bits & ((1 << mantissa_bits) - 1)
    normal = lax.bitcast_convert_type(
        sign | ((exponent + (127 - bias)) << 23) | (mantissa << (23 - mantissa_bits)), jnp.float32)
    subnormal = mantissa.astype(jnp.float32) * np.float32(2.0 ** (1 - bias - mantissa_bits))
    subnormal = jnp.where(sign > 0, -subnormal, subnormal)
    return jnp.where(exponent == 0, subnormal, normal)


def nf4_to_float32(indices: jax.Array) -> jax.Array:
    """nf4 level indices (0..15, any unsigned dtype) as their `NF4_LEVELS`."""
    levels = [jnp.float32(v) for v in NF4_LEVELS]
    for bit in range(4):
        chosen = ((indices >> bit) & 1) == 1
        levels = [jnp.where(chosen, levels[2 * j + 1], levels[2 * j]) for j in range(len(levels) // 2)]
    return levels[0]


def nibbles(packed: jax.Array, signed: bool) -> tuple[jax.Array, jax.Array]:
    """The low and high 4-bit fields of packed bytes: int8 (sign-extended) or uint8.

    Values are packed low nibble first (`odmlq.qarray.pack`), so for a row of
    N values packed into N // 2 bytes these are its even and odd columns.
    """
    if not signed:
        return packed & jnp.uint8(15), packed >> jnp.uint8(4)
    as_int = packed.astype(jnp.int8)
    return (as_int << jnp.int8(4)) >> jnp.int8(4), as_int >> jnp.int8(4)


def interleave(even: jax.Array, odd: jax.Array) -> jax.Array:
    """(..., N // 2) even and odd columns back into (..., N)."""
    return jnp.stack([even, odd], axis=-1).reshape(*even.shape[:-1], -1)
