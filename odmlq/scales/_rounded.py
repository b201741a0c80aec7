"""Weights rounded by their spec's algorithm (internal; `odmlq.scales`).

A weight whose spec names an algorithm (`odmlq.GPTQ`) gets values on its own
grid (its scale from `weight_scale`, computed from the float weight first),
so that quantizing them again, as every backend does, gives the algorithm's
integers exactly. The values are of the weight as it is quantized: with a
folded BatchNorm, the folded kernel.

The weight is rounded against the inputs the quantized model gives it: the
calibration data's (`Gram`), plus, where its op reads a statically quantized
edge, that edge's rounding noise (``step**2 / 12`` on every input, white and
independent of the data). Without it, a second moment with directions the
data hardly varies in (a classifier reading one token) lets GPTQ put error
there that the input's own rounding noise then brings out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from odmlq.algorithms import gptq_round
from odmlq.errors import CalibrationError
from odmlq.scales._tensor import TensorScale

__all__ = ["algorithm_applies", "input_noise", "rounded_weights", "rounded_weight"]


def rounded_weights(plan, values: Mapping[str, Any], weights: Mapping[str, TensorScale],
                    calibration, input_scale: Callable) -> dict[str, np.ndarray]:
    """Parameter path -> rounded values, for every weight with an algorithm.

    Args:
      input_scale: ``(op, edge_id) -> TensorScale | None``, the scale the op
        reads an input edge at (`Scales.input_scale`).

    Raises:
      CalibrationError: the calibration lacks a weight's input statistics.
    """
    return {param: rounded_weight(param, values[param], weights[param], spec, calibration,
                                  input_noise(plan, param, input_scale))
            for param, spec in plan.weight_specs().items() if algorithm_applies(param, spec, calibration)}


def algorithm_applies(param: str, spec, calibration) -> bool:
    """Whether `compute_scales` rounds the weight with its spec's algorithm:
    it has one, and its statistics or a requirement to have them (an
    algorithm that is not `required` rounds to nearest without them)."""
    if spec.algorithm is None:
        return False
    return spec.algorithm.required or (calibration is not None and param in calibration.grams)


def input_noise(plan, param: str, input_scale: Callable) -> float:
    """The rounding noise's variance on each input of the ops reading `param`
    (the largest, where several do): ``step**2 / 12`` of the activation edge
    they read; 0 for a float or dynamically quantized input."""
    noise = 0.0
    for op in plan.graph.ops:
        if op.inputs and any(o.role == "weight" and o.param == param for o in op.operands):
            ts = input_scale(op, op.inputs[0])
            if ts is not None:
                noise = max(noise, float(np.mean(np.square(np.asarray(ts.scale, np.float64)))) / 12)
    return noise


def rounded_weight(param: str, value: Any, ts: TensorScale, spec, calibration,
                   noise: float = 0.0) -> np.ndarray:
    """`value` rounded to the grid of `ts` by `spec.algorithm` (float32), for
    inputs carrying rounding noise of variance `noise` (see `input_noise`).

    Raises:
      CalibrationError: the calibration lacks the weight's input statistics.
    """
    gram = None if calibration is None else calibration.grams.get(param)
    if gram is None:
        raise CalibrationError(
            f"Weight {param!r} is rounded by {spec.algorithm!r}, which needs the inputs the "
            "calibration data gives it: pass the Calibration that odmlq.calibrate made with this "
            "plan, or round it to nearest (weight_algorithm=odmlq.Nearest(), or GPTQ(required=False) where "
            "calibration may be missing).")
    w = np.asarray(value, np.float64)
    layout = gram.layout
    scale = layout.matrix(_full(ts.scale, ts, w.shape))
    zero_point = None if ts.zero_point is None else layout.matrix(_full(ts.zero_point, ts, w.shape))
    qmin, qmax = ts.qtype.range(ts.narrow_range)
    matrix = layout.matrix(w)
    shrinkage = gram.shrinkage()
    moment = gram.matrix
    if getattr(spec.algorithm, "bias_correction", False) and gram.total is not None:
        # The mean error is taken back through the bias afterwards: round for
        # what is left, the error on the inputs' spread around their mean.
        moment = moment - np.einsum("gi,gj->gij", gram.total, gram.total) / gram.rows
    noisy = moment + gram.rows * noise * np.eye(gram.matrix.shape[-1])
    rounded = np.stack([
        gptq_round(matrix[g], scale[g], None if zero_point is None else zero_point[g], qmin, qmax,
                   noisy[g], spec.algorithm, shrinkage=float(shrinkage[g]), where=f"weight {param!r}")
        for g in range(layout.groups)])
    return layout.from_matrix(rounded, w.shape).astype(np.float32)


def _full(values: Any, ts: TensorScale, shape: tuple[int, ...]) -> np.ndarray:
    """A scale or zero point broadcast to every element of the weight."""
    v = np.asarray(values, np.float64)
    if ts.block_axis is not None:
        v = np.repeat(v, ts.block_size, axis=ts.block_axis)
    return np.broadcast_to(v, shape)
