"""QArray: quantized values, scale, zero point and the axes the scale runs along.

Quantize / dequantize with round half to even; int4/nf4 packed two per byte.
`kernels` are the decode routines backends share.
"""

from odmlq.qarray import _kernels as kernels
from odmlq.qarray._array import (
    QArray,
    compute_scale,
    fake_quant,
    float_dtype,
    pack,
    quantize,
    quantize_tensor,
    reduce_range,
    scale_shape,
    unpack,
)
from odmlq.qarray._layout import param_to_blocks, to_blocks
from odmlq.qarray._packing import packed_size

__all__ = [
    "QArray", "compute_scale", "fake_quant", "float_dtype", "kernels", "pack", "packed_size", "param_to_blocks",
    "quantize", "quantize_tensor", "reduce_range", "scale_shape", "to_blocks", "unpack",
]
