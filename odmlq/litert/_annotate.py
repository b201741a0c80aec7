"""Annotation: the planned model as a JAX function with `quant.fake_quant`
composites on every quantized edge and weight, ready for litert-converter.

Protocol (litert-converter 0.5.0, strict QDQ mode): a composite named
``quant.fake_quant`` with one operand and the attributes ``dtype`` ('i8',
'i16', 'i4'), ``scale`` (1-D float32), ``zero_point`` (1-D int64),
``narrow_range`` (always present: jax drops a plain False attribute, and a
composite without it is left unlowered) and, per channel,
``quantization_dimension``. Its decomposition is the same fake-quant that
`odmlq.simulate` computes.

Weights are annotated in the layout LiteRT kernels store them in (output
channels first: (out, in) for FULLY_CONNECTED, OHWI for CONV_2D) and
transposed back for the op, so the converter folds the whole chain into one
constant and emits no DEQUANTIZE or TRANSPOSE at run time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from odmlq.errors import OdmlqError
from odmlq.scales import Scales, TensorScale, flat_params, replace_params

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
    from odmlq.qtypes import qtype as lookup

    qt = lookup(ts.qtype)
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


def _weight_channel_axes(plan) -> dict[str, int]:
    out: dict[str, int] = {}
    for op in plan.graph.ops:
        for w in op.weights:
            if w.role == "weight" and w.channel_axes and len(w.channel_axes) == 1:
                out.setdefault(w.param, w.channel_axes[0])
    return out


def _annotated_weight(w: np.ndarray, ts: TensorScale, channel_axis: int | None) -> jax.Array:
    axis = ts.scale_axes[0] if ts.scale_axes else channel_axis
    if axis is None or w.ndim < 2:
        return fake_quant_composite(jnp.asarray(w), ts)
    perm = (axis, *[a for a in range(w.ndim) if a != axis])
    inverse = tuple(int(i) for i in np.argsort(perm))
    native = np.transpose(w, perm)
    ts_native = ts
    if ts.scale_axes:
        ts_native = _permuted(ts, perm)
    quantized = fake_quant_composite(jnp.asarray(native), ts_native, 0 if ts.scale_axes else None)
    return jnp.transpose(quantized, inverse)


def _permuted(ts: TensorScale, perm) -> TensorScale:
    import dataclasses

    scale = np.transpose(ts.scale, perm)
    zp = None if ts.zero_point is None else np.transpose(ts.zero_point, perm)
    return dataclasses.replace(ts, scale=scale, zero_point=zp, scale_axes=(0,))


def annotated_function(graph, plan, scales: Scales, params: Any) -> Callable:
    """A function of the model inputs only (weights are constants in it)."""
    values = {k: np.asarray(v) for k, v in flat_params(params).items()}
    channel_axes = _weight_channel_axes(plan)
    for path, ts in scales.weights.items():
        if len(ts.scale_axes) > 1 or ts.block_size is not None:
            raise OdmlqError(
                f"Weight {path!r} has {ts.scale_axes} scale axes / blocks; LiteRT takes one "
                "quantized dimension. This should have been refused by the plan check."
            )

    def fn(*inputs):
        from odmlq.scales import fake_quant_bias

        new = {}
        for p, ts in scales.weights.items():
            with jax.named_scope(p):
                new[p] = _annotated_weight(values[p], ts, channel_axes.get(p))
        for p, s in scales.biases.items():
            new[p] = fake_quant_bias(jnp.asarray(values[p]), s)
        qparams = replace_params(params, new)

        def on_edge(edge_id, x):
            ts = scales.edges.get(edge_id)
            if ts is None or ts.scale_axes:
                return x
            with jax.named_scope(edge_id):
                return fake_quant_composite(x, ts)

        return graph.evaluate(qparams, *inputs, on_edge=on_edge)

    return fn
