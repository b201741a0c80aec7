"""Quantizing a tensor that is sharded over a mesh, where it lies.

The codes are computed under `jax.jit` with the float tensor's sharding in
and the layout of `odmlq.sharding` out, so no device gathers the tensor.
They are the same codes `quantize` gives on one device: the same kernel, on
the same float32 values and scales.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import NamedSharding

from odmlq.qarray import _kernels as kernels
from odmlq.qarray._packing import packed_size
from odmlq.qtypes import QType
from odmlq.sharding import named, placed, quantized_placement

__all__ = ["quantize_and_pack_sharded"]


def quantize_and_pack_sharded(x: jax.Array, scale, zero_point, qt: QType, bounds, kernel,
                              block_axis, block_size):
    """``(qvalue, scale, zero_point)`` of `kernels.quantize_and_pack`, each
    placed on `x`'s mesh (`odmlq.sharding`)."""
    sharding = named(x, "The tensor to quantize")
    stored = (packed_size(x.size, qt),) if qt.values_per_byte > 1 else x.shape
    values, scales = quantized_placement(sharding, x.shape, stored, scale.shape)
    scale = jax.device_put(scale, scales)
    zero_point = None if zero_point is None else jax.device_put(zero_point, scales)

    qvalue = _quantizer(kernel, block_axis, block_size, values)(x, scale, zero_point, bounds)
    return qvalue, scale, zero_point


@functools.lru_cache(maxsize=256)
def _quantizer(kernel: kernels.Kernel, block_axis, block_size, out: NamedSharding):
    """One compiled quantizer per layout and placement, reused by every weight that shares them."""
    def run(x, scale, zero_point, bounds):
        return kernels.quantize_and_pack(x, scale, zero_point, bounds, kernel, block_axis, block_size)
    return placed(run, out)
