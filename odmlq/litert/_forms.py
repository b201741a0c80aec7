"""Ops written in forms litert-converter 0.5.0 lowers to LiteRT's integer (or
XNNPACK's) kernels, the values unchanged (internal; used by `_annotate`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from odmlq.scales import TensorScale


def gelu_erf(x):
    """The exact GELU as x/2 (1 + erf(x / sqrt 2))."""
    return x * 0.5 * (1.0 + jax.lax.erf(x * np.float32(np.sqrt(0.5))))


def reciprocal_scale(ts: TensorScale, reciprocal: float) -> TensorScale:
    """A scalar's quantization in the divisor's qtype, at its largest integer (exact)."""
    qt = ts.qtype
    return dataclasses.replace(ts, scale=np.asarray(abs(reciprocal) / qt.qmax, np.float32),
                               zero_point=None if ts.zero_point is None else np.zeros_like(ts.zero_point))


def max_pool_padded_with_zeros(op, x: jax.Array) -> jax.Array:
    """A padded max pool of non-negative values as PAD (zeros) and a VALID
    MAX_POOL_2D: the same maximum, with int16 kernels for both (the
    converter pads an int16 pool with PADV2, which has none)."""
    padded = jnp.pad(x, [tuple(p) for p in op.attributes["padding"]])
    return jax.lax.reduce_window(padded, -jnp.inf, jax.lax.max, tuple(op.attributes["window"]),
                                 tuple(op.attributes["strides"]), "VALID")


def avg_pool_padded_with_zeros(op, x: jax.Array) -> jax.Array:
    """An average pool that counts its padding (``count_include_pad``) as PAD
    (zeros) and a VALID AVERAGE_POOL_2D: the same sums and divisor. Handed
    over as it is traced, litert-converter 0.5.0 leaves a float
    STABLEHLO_REDUCE_WINDOW and MUL."""
    padded = jnp.pad(x, [tuple(p) for p in op.attributes["padding"]])
    total = jax.lax.reduce_window(padded, 0.0, jax.lax.add, tuple(op.attributes["window"]),
                                  tuple(op.attributes["strides"]), "VALID")
    return total / float(op.attributes["window_size"])
