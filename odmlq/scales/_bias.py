"""Room for int32 biases: a weight scale never so fine that its op's bias overflows.

An integer matmul or convolution adds its bias to the int32 accumulator at
the scale ``input scale x weight scale`` (per output channel). A channel
whose weights are all but zero (a "dead" channel: trained weights of 1e-7,
or a BatchNorm with zero variance folded in) gets a tiny weight scale, and
its bias in those units passes 2**31: the converter and the kernels then
saturate or wrap it, each its own way, and the channel's output is wrong by
the whole bias. TensorFlow Lite's own quantizer widens such a channel's
weight scale; so does odmlq, in the scales every backend reads, so XLA,
LiteRT and simulate keep computing the same numbers.

The widened channel's weights round to fewer levels (often all to zero),
which costs nothing measurable: they are below ``|bias| / 2**30`` of an
accumulator step, so ``sum(w x)`` is far under one output step next to the
bias.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from odmlq.graph import folded_bias, operand_values
from odmlq.scales._tensor import TensorScale

__all__ = ["BIAS_LIMIT", "Int32Bias", "bias_corrections", "bias_room", "int32_bias_ops"]

# Largest |bias| in accumulator units. Half of int32's range leaves the other
# half for the products the kernel adds to it (K x 127 x 255 < 2**30 for any
# K under 33,000).
BIAS_LIMIT = 2.0**30


class Int32Bias(NamedTuple):
    """An op whose integer kernel adds an int32 bias at ``input_scale x`` its kernel's scale."""

    op: Any
    fold: bool  # the bias is a folded BatchNorm's ``b s + t`` (computed where the op runs)
    biases: list  # the op's own bias WeightPlans (none for a fold without one)
    kernel: str  # the kernel's parameter path
    input_scale: float


def int32_bias_ops(plan, scales) -> list[Int32Bias]:
    """The ops that add an int32 bias: a bias or a folded BatchNorm, one integer
    kernel (per tensor or per channel, not blocks or stacked layers), and a
    statically quantized per-tensor input."""
    found = []
    for op in plan.graph.ops:
        fold = bool(op.attributes.get("fold"))
        biases = [w for w in plan.ops[op.id].weights if w.role == "bias"]
        kernels = [w for w in plan.ops[op.id].weights if w.role == "weight" and w.spec is not None]
        if not (biases or fold) or len(kernels) != 1 or not op.inputs:
            continue
        spec = kernels[0].spec
        stacked = any(o.param == kernels[0].param and o.stacked_axes for o in op.operands)
        if spec.qtype.kind != "int" or spec.block_size or len(spec.scale_axes) > 1 or stacked:
            continue  # layers stacked by nn.scan: their biases stay float for now
        source = scales.input_scale(plan, op, op.inputs[0])
        if source is None or source.scale_axes:
            continue
        found.append(Int32Bias(op, fold, biases, kernels[0].param,
                               float(np.asarray(source.scale).reshape(-1)[0])))
    return found


def bias_room(plan, scales, weights: Mapping[str, TensorScale], values: Mapping[str, Any],
              params: Any) -> dict[str, TensorScale]:
    """`weights` with each kernel's per-channel scale raised to at least
    ``|bias| / (input scale x BIAS_LIMIT)`` where the op adds an int32 bias
    (its own, or a folded BatchNorm's ``b s + t``).

    Args:
      scales: the edges' scales (inputs of the ops).
      values: flat parameter path -> value, BatchNorms folded in.
      params: the float params (for folded biases, computed from them).
    """
    out = dict(weights)
    candidates = int32_bias_ops(plan, scales)
    folded = {c.op.id for c in candidates if c.fold}
    operands = operand_values(plan.graph, params, folded) if folded else {}
    for c in candidates:
        if c.fold:
            bias = np.abs(np.asarray(folded_bias(c.op, operands[c.op.id]), np.float64))
        else:
            bias = np.max([np.abs(np.asarray(values[b.param], np.float64)).reshape(-1) for b in c.biases],
                          axis=0)
        ts = out[c.kernel]
        scale = np.asarray(ts.scale, np.float64)
        needed = bias / (c.input_scale * BIAS_LIMIT)
        needed = needed.reshape(scale.shape) if scale.size == needed.size else needed.max()
        if np.any(needed > scale):
            out[c.kernel] = dataclasses.replace(ts, scale=np.maximum(scale, needed).astype(np.float32))
    return out


def bias_corrections(plan, values: Mapping[str, Any], weight_values: Mapping[str, np.ndarray],
                     calibration) -> dict[str, np.ndarray]:
    """Op id -> the per-channel shift that takes back a rounded weight's average output error.

    For a folded op whose kernel's algorithm asks for it (``GPTQ(bias_correction=True)``):
    ``-(q - w) E[p]`` per output channel, ``q`` the rounded kernel, ``w`` the
    float one (both with the BatchNorm folded in), ``E[p]`` the calibration
    inputs' mean patch (`Gram.total`). Added to the op's folded bias like a
    balanced sum's shift (`Scales.shifts`), so every backend computes it.
    """
    out: dict[str, np.ndarray] = {}
    specs = plan.weight_specs()
    for op in plan.graph.ops:
        if not op.attributes.get("fold"):
            continue
        for operand in op.operands:
            spec = specs.get(operand.param) if operand.role == "weight" else None
            algorithm = None if spec is None else spec.algorithm
            gram = None if calibration is None else calibration.grams.get(operand.param)
            if (not getattr(algorithm, "bias_correction", False) or operand.param not in weight_values
                    or gram is None or gram.total is None):
                continue
            delta = gram.layout.matrix(np.asarray(weight_values[operand.param], np.float64)
                                       - np.asarray(values[operand.param], np.float64))
            mean = gram.total / gram.rows
            out[op.id] = -np.einsum("got,gt->go", delta, mean).reshape(-1).astype(np.float32)
    return out
