"""1-D convolutions as LiteRT's 2-D kernels (internal; used by `_annotate`).

LiteRT has no 1-D convolution. The export computes each as the 2-D one over
a spatial axis of size 1 placed after the spatial axis, and stores its
filter with that axis (`_annotate._native_layouts`). The laid-out input is
named in `INPUT_LAYOUT`'s scope, so no tensor of it is taken for the op's
output (`_mapping`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
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


def with_unit_axis(ts: TensorScale, axis: int) -> TensorScale:
    """`ts` for its tensor with an axis of size 1 inserted at `axis`."""
    scale = np.expand_dims(ts.scale, axis) if np.ndim(ts.scale) else ts.scale
    zp = ts.zero_point if ts.zero_point is None or not np.ndim(ts.zero_point) else np.expand_dims(ts.zero_point, axis)
    return dataclasses.replace(ts, scale=scale, zero_point=zp,
                               scale_axes=tuple(a + (a >= axis) for a in ts.scale_axes))
