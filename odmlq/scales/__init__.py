"""Scales: the plan's specs turned into numbers (see `compute_scales`).

`TensorScale` is how one tensor is quantized; `Scales` holds every edge's,
weight's, bias's and constant's of a plan, which simulate and both backends
quantize with.
"""

from odmlq.graph import flat_params
from odmlq.scales._bias import BIAS_LIMIT, bias_corrections, bias_room, int32_bias_ops
from odmlq.scales._edges import MAX_EDGE_SCALE
from odmlq.scales._rounded import algorithm_applies, rounded_weight
from odmlq.scales._scales import (Scales, compute_scales, fake_quant_bias, folded_weights, quantized_params,
                                 weight_scale)
from odmlq.scales._tensor import TensorScale, constant_scale

__all__ = [
    "BIAS_LIMIT", "MAX_EDGE_SCALE", "bias_corrections", "bias_room", "int32_bias_ops", "Scales", "algorithm_applies", "TensorScale", "compute_scales", "constant_scale", "fake_quant_bias",
    "flat_params", "folded_weights", "rounded_weight", "quantized_params", "weight_scale",
]
