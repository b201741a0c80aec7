"""1-D convolutions and pools as LiteRT's 2-D kernels (internal; used by `_annotate`).

LiteRT has no 1-D convolution or pool. The export computes each as the 2-D
one over a spatial axis of size 1 placed after the spatial axis, and stores
a convolution's filter with that axis (`_weights.native_layouts`). The
laid-out input is named in `INPUT_LAYOUT`'s scope, so no tensor of it is
taken for the op's output (`_mapping`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from odmlq.graph import evaluate_replacing
from odmlq.litert._mapping import INPUT_LAYOUT
from odmlq.scales import TensorScale


def one_dimensional_as_two(compute, inputs, mark=None) -> list:
    """The op with each 1-D convolution in it computed as a 2-D one over a
    spatial axis of size 1 after the spatial axis (NWC as NW1C, WIO as W1IO),
    the unit axis dropped from its result; other convolutions as they are.

    litert-converter 0.5.0 makes CONV_2D of a 1-D convolution itself where the
    filter is an int8 constant, but fails in its dynamic-range mode ('Invalid
    ranks') and, with int8 weights and float inputs, transposes the
    dequantized filter at every invocation. Given the 2-D form, it folds the
    filter's layout in both (wav2vec2's feature extractor).

    `mark`: the dynamic-range marker, put on the 2-D input (a dynamic input
    marked before it is laid out failed as well)."""
    closed = jax.make_jaxpr(compute)(*inputs)
    two = functools.partial(_as_two_dimensional, mark=mark)
    ones = {i: two for i, e in enumerate(closed.jaxpr.eqns)
            if e.primitive.name == "conv_general_dilated" and len(e.params["window_strides"]) == 1}
    # A 1-D pool's window over (batch, width, channels): litert-converter 0.5.0
    # left it a STABLEHLO_REDUCE_WINDOW (float, off XNNPACK; in a full-integer
    # export, a float island). As 2-D it is MAX_POOL_2D or AVERAGE_POOL_2D.
    ones.update({i: _pooled_as_two_dimensional for i, e in enumerate(closed.jaxpr.eqns)
                 if e.primitive.name in _POOLS and len(e.params["window_dimensions"]) == 3
                 and e.params["window_dimensions"][0] == e.params["window_dimensions"][2] == 1})
    if not ones:
        return compute(*inputs)
    return evaluate_replacing(closed, inputs, ones)


def _as_two_dimensional(eqn, ins, mark) -> list:
    params = eqn.params

    def unit_after_spatial(spec):
        at = spec[2] + 1
        return (*(a + (a >= at) for a in spec), at), at

    (lhs, lat), (rhs, rat), (out, oat) = map(unit_after_spatial, params["dimension_numbers"])
    rest = {k: v for k, v in params.items() if k not in (
        "dimension_numbers", "window_strides", "padding", "lhs_dilation", "rhs_dilation")}
    with jax.named_scope(INPUT_LAYOUT):
        x = jax.lax.expand_dims(ins[0], (lat,))
    y = jax.lax.conv_general_dilated_p.bind(
        x if mark is None else mark(x), jax.lax.expand_dims(ins[1], (rat,)),
        dimension_numbers=jax.lax.ConvDimensionNumbers(lhs, rhs, out),
        window_strides=(*params["window_strides"], 1), padding=(*params["padding"], (0, 0)),
        lhs_dilation=(*params["lhs_dilation"], 1), rhs_dilation=(*params["rhs_dilation"], 1), **rest)
    return [jax.lax.squeeze(y, (oat,))]


_POOLS = frozenset({"reduce_window_max", "reduce_window_min", "reduce_window_sum"})


def _pooled_as_two_dimensional(eqn, ins) -> list:
    params = dict(eqn.params)
    for name in ("window_dimensions", "window_strides", "base_dilation", "window_dilation"):
        params[name] = (*params[name][:2], 1, params[name][2])
    params["padding"] = (*params["padding"][:2], (0, 0), params["padding"][2])
    with jax.named_scope(INPUT_LAYOUT):
        x = jax.lax.expand_dims(ins[0], (2,))
    return [jax.lax.squeeze(eqn.primitive.bind(x, **params), (2,))]


def average_pool_as_two_dimensional(op, x: jax.Array, qtype: str | None, mark) -> jax.Array:
    """A 1-D average pool (`op`'s window over (batch, width, channels)) as the
    2-D one over a unit axis after the width, in the form its 2-D kernel takes
    (`_annotate`): int8 as a depthwise convolution XNNPACK runs, otherwise as
    AVERAGE_POOL_2D (the sum over the window divided by its size, or by its
    count of real values for a pool that does not count its padding)."""
    from odmlq.litert._forms import avg_pool_padded_with_zeros, pool_as_depthwise_conv
    from odmlq.litert.spec import pool_as_depthwise

    a = op.attributes
    two = dataclasses.replace(op, attributes={
        **a, **{k: [*a[k][:2], unit, a[k][2]] for k, unit in (("window", 1), ("strides", 1), ("padding", [0, 0]))}})
    with jax.named_scope(INPUT_LAYOUT):
        x = jax.lax.expand_dims(x, (2,))
    if pool_as_depthwise(two, qtype):
        y = pool_as_depthwise_conv(two, x, mark)
    elif a.get("counts_padding") or not any(lo or hi for lo, hi in a["padding"]):
        y = avg_pool_padded_with_zeros(two, x)
    else:  # divided by the count of real values in each window, as Flax's 2-D form
        window, strides = tuple(two.attributes["window"]), tuple(two.attributes["strides"])
        padding = tuple(map(tuple, two.attributes["padding"]))
        total = jax.lax.reduce_window(x, 0.0, jax.lax.add, window, strides, padding)
        ones = jnp.ones((1, *x.shape[1:3], 1), x.dtype)
        y = total / jax.lax.reduce_window(ones, 0.0, jax.lax.add, window, strides, padding)
    return jax.lax.squeeze(y, (2,))


def with_unit_axis(ts: TensorScale, axis: int) -> TensorScale:
    """`ts` for its tensor with an axis of size 1 inserted at `axis`."""
    scale = np.expand_dims(ts.scale, axis) if np.ndim(ts.scale) else ts.scale
    zp = ts.zero_point if ts.zero_point is None or not np.ndim(ts.zero_point) else np.expand_dims(ts.zero_point, axis)
    return dataclasses.replace(ts, scale=scale, zero_point=zp,
                               scale_axes=tuple(a + (a >= axis) for a in ts.scale_axes))
