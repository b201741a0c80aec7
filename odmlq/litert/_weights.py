"""How a quantized weight is written into the LiteRT file (internal;
`_annotate.annotated_function`): in the layout the kernel stores it in
(output channels first: (out, in) for FULLY_CONNECTED, OHWI for CONV_2D;
(1, H, W, out) for DEPTHWISE_CONV_2D), in a composite, transposed back for
the op, so the converter folds the chain into one constant and emits no
DEQUANTIZE or TRANSPOSE at run time; or, with external weights, as a
placeholder whose integers `_external` writes after the flatbuffer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from odmlq.errors import OdmlqError
from odmlq.litert._composites import fake_quant_composite
from odmlq.litert._conv1d import with_unit_axis
from odmlq.litert._external import Placeholder
from odmlq.scales import TensorScale

__all__ = ["annotated_weight", "native_layouts", "weight_placeholder", "zeros"]


def native_layouts(plan) -> dict[str, tuple[int, ...]]:
    """Parameter path -> (permutation to the kernel's layout, its channel axis)
    and, for a 1-D convolution's filter, its spatial axis (a unit axis follows it).

    FULLY_CONNECTED and CONV_2D store output channels first ((out, in), OHWI).
    A convolution with one input feature per group becomes DEPTHWISE_CONV_2D,
    which stores (1, H, W, out): output channels last.
    """
    out: dict[str, tuple] = {}
    for op in plan.graph.ops:
        for w in op.weights:
            if w.role != "weight" or not w.channel_axes or len(w.channel_axes) != 1:
                continue
            # A layer-stacked weight is annotated per layer (`_stacked`): its axes without the stack's.
            channel, *contraction = (a - sum(s < a for s in w.stacked_axes)
                                     for a in (w.channel_axes[0], *(w.contraction_axes or ())))
            others = [a for a in range(len(w.shape)) if a != channel]
            # A 1-D convolution's filter is stored as the 2-D kernel LiteRT runs
            # it with (`_conv1d.one_dimensional_as_two`): its spatial axis is followed by
            # one of size 1, (O, W, 1, I) or, depthwise, (1, W, 1, O).
            spatial = ((next(a for a in others if a not in contraction),)
                       if op.kind == "conv" and len(w.shape) == 3 and len(contraction) == 1 else ())
            if op.kind == "conv" and len(contraction) == 1 and w.shape[contraction[0]] == 1:
                rest = [a for a in others if a != contraction[0]]
                out.setdefault(w.param, ((contraction[0], *rest, channel), len(w.shape) - 1, *spatial))
            elif spatial:
                out.setdefault(w.param, ((channel, *spatial, *contraction), 0, *spatial))
            else:
                out.setdefault(w.param, ((channel, *others), 0))
    return out


def annotated_weight(w: np.ndarray | jax.ShapeDtypeStruct, ts: TensorScale, layout) -> jax.Array:
    """`w` in the kernel's layout in a composite, transposed back; a
    `jax.ShapeDtypeStruct` (a placeholder) stands for zeros of its shape."""
    if layout is None or len(w.shape) < 2:
        return fake_quant_composite(_value(w), ts)
    perm, channel, *unit = layout
    if ts.scale_axes and perm[channel] != ts.scale_axes[0]:
        raise OdmlqError(f"Per-channel axis {ts.scale_axes[0]} is not the kernel's output-channel "
                         f"axis {perm[channel]}; LiteRT quantizes weights along output channels.")
    inverse = tuple(int(i) for i in np.argsort(perm))
    native = (jax.ShapeDtypeStruct(tuple(w.shape[a] for a in perm), w.dtype)
              if isinstance(w, jax.ShapeDtypeStruct) else np.transpose(w, perm))
    ts_native = _permuted(ts, perm) if ts.scale_axes else ts
    if unit:
        # (O, W, I) as (O, W, 1, I), transposed to the parameter's axes with the
        # unit axis after the spatial one, which is where the 2-D convolution
        # adds it: the converter folds the two reshapes, and the transpose
        # into its own filter layout, as for a 2-D filter.
        after = perm.index(unit[0]) + 1
        native4 = jnp.expand_dims(_value(native), after)
        quantized = fake_quant_composite(native4, with_unit_axis(ts_native, after),
                                         channel + (channel >= after) if ts.scale_axes else None)
        at = unit[0] + 1
        axes = (*perm[:after], None, *perm[after:])
        order = [axes.index(a - (a > at) if a != at else None) for a in range(4)]
        return jnp.squeeze(jnp.transpose(quantized, order), at)
    quantized = fake_quant_composite(_value(native), ts_native, channel if ts.scale_axes else None)
    return jnp.transpose(quantized, inverse)


def _permuted(ts: TensorScale, perm) -> TensorScale:
    scale = np.transpose(ts.scale, perm)
    zp = None if ts.zero_point is None else np.transpose(ts.zero_point, perm)
    return dataclasses.replace(ts, scale=scale, zero_point=zp,
                               scale_axes=(perm.index(ts.scale_axes[0]),))


def zeros(shape) -> jax.ShapeDtypeStruct:
    """A placeholder (see `_value`)."""
    return jax.ShapeDtypeStruct(tuple(int(d) for d in shape), jnp.float32)


def _value(w) -> jax.Array:
    """`w` as a constant; a placeholder as zeros made in the traced function,
    one value in the StableHLO text however large the weight."""
    return jnp.zeros(w.shape, w.dtype) if isinstance(w, jax.ShapeDtypeStruct) else jnp.asarray(w)


def weight_placeholder(param: str, shape, ts: TensorScale, layout, grid, blocks) -> Placeholder:
    """The weight as `_external` writes it: its integers in the kernel's layout."""
    perm = layout[0] if layout is not None else tuple(range(len(shape)))
    native_shape = tuple(int(shape[a]) for a in perm)
    if layout is not None and len(layout) > 2:  # a 1-D convolution's filter, with its unit axis
        after = perm.index(layout[2]) + 1
        native_shape = (*native_shape[:after], 1, *native_shape[after:])
    if blocks:  # int4 blocks: the payload's (out, in) integers, what the file holds
        return Placeholder(param, blocks[0].codes.shape, "int4", lambda: blocks[0].codes)

    def codes():
        # (In place where it can: a weight of N values costs about 4N bytes here,
        # besides its float values.)
        t = _permuted(ts, perm) if ts.scale_axes else ts
        q = np.transpose(grid(param), perm) / np.asarray(t.scale, np.float32)
        np.rint(q, out=q)
        if t.zero_point is not None:
            q += np.asarray(t.zero_point, np.float32)
        np.clip(q, int(ts.qtype.qmin), int(ts.qtype.qmax), out=q)
        return q.astype(np.int16 if ts.qtype.name == "int16" else np.int8).reshape(native_shape)

    return Placeholder(param, native_shape, str(ts.qtype.name), codes)
