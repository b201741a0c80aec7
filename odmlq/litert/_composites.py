"""The markers the converter reads: a `quant.fake_quant` composite per quantized
tensor (its decomposition is the float fake-quant, so the function also runs
as it is), and an unscaled one for an input quantized at run time."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from odmlq.scales import TensorScale

_DTYPES = {"int8": "i8", "int16": "i16", "int4": "i4"}


def _fake_quant_decomposition(x, *, dtype, scale, zero_point, narrow_range,
                              quantization_dimension=None, qmin, qmax):
    lo = qmin + (1 if bool(narrow_range) else 0)
    if quantization_dimension is None:
        # Python scalars: an array constant would become a second operand of the
        # composite, which the converter does not lower.
        s = float(np.asarray(scale).reshape(()))
        zp = float(np.asarray(zero_point).reshape(()))
    else:
        shape = [1] * x.ndim
        shape[quantization_dimension] = -1
        s = jnp.asarray(np.asarray(scale, np.float32).reshape(shape))
        zp = jnp.asarray(np.asarray(zero_point, np.float32).reshape(shape))
    q = jnp.clip(jnp.round(x / s) + zp, lo, qmax)
    return (q - zp) * s


def fake_quant_composite(x: jax.Array, ts: TensorScale, quantization_dimension: int | None = None):
    """`x` wrapped in a `quant.fake_quant` composite for `ts`."""
    qt = ts.qtype
    attrs = dict(
        dtype=_DTYPES[qt.name],
        scale=np.asarray(ts.scale, np.float32).reshape(-1),
        zero_point=(np.zeros(np.size(ts.scale), np.int64) if ts.zero_point is None
                    else np.asarray(ts.zero_point, np.int64).reshape(-1)),
        narrow_range=np.bool_(ts.narrow_range),
    )
    if quantization_dimension is not None:
        attrs["quantization_dimension"] = int(quantization_dimension)
    decomposition = functools.partial(_fake_quant_decomposition, qmin=int(qt.qmin), qmax=int(qt.qmax))
    return jax.lax.composite(lambda v, **kw: decomposition(v, **kw), name="quant.fake_quant")(x, **attrs)


def dynamic_range_composite(x: jax.Array) -> jax.Array:
    """Marks `x` as quantized at run time: a `quant.fake_quant` with no scale.

    In the converter's DYNAMIC mode this makes the consuming kernel a
    dynamic-range one (int8 weights, the input quantized per call). Its
    decomposition is the identity: the quantization happens in the kernel.
    """
    attrs = dict(dtype="i8", scale=np.zeros((0,), np.float32), zero_point=np.zeros((0,), np.int64),
                 narrow_range=np.bool_(False))
    return jax.lax.composite(lambda v, **kw: v, name="quant.fake_quant")(x, **attrs)
