"""Quantized convolutions for XLA.

Internal; `odmlq.xla._lowering` decides which op gets which kernel.
`conv_float` dequantizes the kernel (one fused pass: a convolution reuses
each weight at every output position, so this costs little) and convolves in
float32; `conv_int` convolves int8 codes into int32 with one rescale. An
asymmetric input is padded with its zero point's code, so that padding stays
0.0, and the zero point's share (zero point x the kernel's sums) is
subtracted from the int32 sums.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from odmlq.qarray import param_to_blocks, to_blocks
from odmlq.qarray import QArray
from odmlq.xla import _decode


def dequantized_kernel(q: QArray) -> jax.Array:
    """``q.dequantize()``, decoded with `odmlq.xla._decode` (one fused pass)."""
    kind = q.qtype_info.kind
    values = q.qvalue
    if q.qtype_info.values_per_byte == 2:
        values = _decode.interleave(*_decode.nibbles(values, signed=kind == "int")).reshape(-1)
        values = values[:math.prod(q.shape)]
    values = values.reshape(q.shape)
    if kind == "lut":
        values = _decode.nf4_to_float32(values)
    elif kind == "float":
        values = _decode.fp8_to_float32(values)
    else:
        values = values.astype(jnp.int32)
    blocks = to_blocks(values, q.block_axis, q.block_size)
    if q.zero_point is not None:
        blocks = blocks - param_to_blocks(q.zero_point, q.block_axis)
    return (blocks.astype(jnp.float32) * param_to_blocks(q.scale, q.block_axis)).reshape(q.shape)


def conv_float(x: jax.Array, q: QArray, params: dict) -> jax.Array:
    """The convolution with the kernel dequantized (XLA fuses it into one pass
    over the kernel; convolutions reuse each weight many times)."""
    return lax.conv_general_dilated_p.bind(x.astype(jnp.float32), dequantized_kernel(q), **_float_params(params))


def _float_params(params: dict) -> dict:
    return {**params, "preferred_element_type": None}


def conv_int(xq: jax.Array, x_zero_point: jax.Array | None, q: QArray, params: dict) -> jax.Array:
    """int8 convolution into int32, minus the zero point's share, in float32
    (times the weight scale along the output features)."""
    dn = params["dimension_numbers"]
    w = q.values().astype(jnp.int8)
    int_params = {**params, "preferred_element_type": jnp.int32}
    per_pixel = x_zero_point is not None and x_zero_point.size > xq.shape[dn.lhs_spec[0]]
    if x_zero_point is not None and not per_pixel:
        # Pad with the zero point's code (0.0), not with code 0.
        spatial = dn.lhs_spec[2:]
        config = [(0, 0, 0)] * xq.ndim
        for axis, (lo, hi) in zip(spatial, params["padding"]):
            config[axis] = (lo, hi, 0)
        if x_zero_point.size == 1:
            xq = lax.pad(xq, x_zero_point.reshape(()).astype(jnp.int8), config)
        else:  # one zero point per batch row
            padded = lax.pad(xq, jnp.int8(0), config)
            mask = lax.pad(jnp.zeros(xq.shape, jnp.bool_), True, config)
            xq = jnp.where(mask, x_zero_point.astype(jnp.int8), padded)
        int_params["padding"] = tuple((0, 0) for _ in spatial)
    acc = lax.conv_general_dilated_p.bind(xq, w, **int_params)
    out_feature = dn.out_spec[1]
    shape = [1] * acc.ndim
    shape[out_feature] = acc.shape[out_feature]
    if x_zero_point is not None:
        sums = jnp.sum(w.astype(jnp.int32), axis=tuple(a for a in range(w.ndim) if a != dn.rhs_spec[0]))
        if per_pixel:  # a 1x1 convolution of stride 1, unpadded: each output pixel reads its own input pixel
            zp = output_layout(x_zero_point, dn).astype(jnp.int32)
        else:
            zp = jnp.reshape(x_zero_point, (-1,))
            zp_shape = [1] * acc.ndim
            zp_shape[dn.out_spec[0]] = zp.shape[0]
            zp = zp.reshape(zp_shape)
        acc = acc - zp * sums.reshape(shape)
    return acc.astype(jnp.float32) * jnp.reshape(q.scale, shape)


def weight_scale_axis(q: QArray) -> int | None:
    """The one axis a weight's scale varies along (-1: none; None: several or blocks)."""
    if q.block_axis is not None:
        return None
    varying = [a for a, d in enumerate(q.scale.shape) if d != 1]
    if len(varying) > 1:
        return None
    return varying[0] if varying else -1


def output_layout(p: jax.Array, dn) -> jax.Array:
    """A keepdims array in the convolution input's layout (a per-pixel scale or
    zero point) laid out as its output: axis by axis, batch, feature, spatial."""
    perm = [dn.lhs_spec[list(dn.out_spec).index(a)] for a in range(p.ndim)]
    return jnp.transpose(p, perm)
