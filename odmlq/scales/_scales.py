"""Scales: the plan's specs turned into numbers.

`compute_scales(plan, calibration, params)` gives every quantized edge and
weight its scale and zero point: weights from their own values (with the
weight calibration method of their spec), edges from the calibration
statistics (`odmlq.scales._edges`), biases of quantized matmuls and
convolutions from the product of their input and weight scales (int32, as
integer kernels add them to the int32 accumulator), constant operands of
elementwise ops and values derived from parameters from their values
(`constant_scale`). Backends and `simulate` all quantize with the same
`Scales`, so their results line up value for value.

Where the plan balances a sum's offsets (`Plan.balanced_sums`), the two
operands' ranges come from their per-channel calibration once shifted, and
`Scales.shifts` holds each op's shift (`odmlq.scales._balance`).

Where the plan's targets constrain an edge (`EdgePlan.constraint`, resolved
when the plan was made), its scale follows the constraint: its input's,
shared with the inputs of the op that reads it, or fixed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from odmlq.calibration import Calibration, range_of
from odmlq.constraints import SharedWithInputs
from odmlq.errors import PlanError
from odmlq.graph import flat_params, fold_params, operand_values, replace_params
from odmlq.plan import op_qtype
from odmlq.qarray import QArray, scale_shape
from odmlq.scales._balance import balance_shifts
from odmlq.scales._bias import bias_corrections, bias_room, int32_bias_ops
from odmlq.scales._edges import _calibrated_scale, check_edge_scales, edge_scales
from odmlq.scales._outputs import int8_outputs
from odmlq.scales._clip import clip_searched
from odmlq.scales._rounded import rounded_weights
from odmlq.scales._tensor import TensorScale, constant_scale, reshaped, tensor_scale

_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Scales:
    """Scales of edges (by edge id), weights and biases (by parameter path), and
    constant operands (by ``(op id, index in Op.constants)``)."""

    edges: dict[str, TensorScale]
    weights: dict[str, TensorScale]
    biases: dict[str, np.ndarray]  # bias scale per output channel (int32, zero point 0)
    constants: dict[tuple[str, int], TensorScale] = dataclasses.field(default_factory=dict)
    # (edge id, qtype) -> the scale an op of that qtype reads the edge at (see
    # `Plan.conversions`).
    conversions: dict[tuple[str, str], TensorScale] = dataclasses.field(default_factory=dict)
    # op id -> the int32 bias scale of an op with a folded BatchNorm (its bias
    # is ``b * s + t``, computed where the op runs; `odmlq.graph.folded_bias`).
    op_biases: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # (op id, operand index) -> the scale an elementwise op reads a value
    # derived from parameters at (`WeightPlan.read_as`).
    derived: dict[tuple[str, int], TensorScale] = dataclasses.field(default_factory=dict)
    # parameter path -> the weight as its spec's algorithm rounded it (`odmlq.GPTQ`),
    # float32 values on its grid (folded, where a BatchNorm is); see `folded_weights`.
    weight_values: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # op id -> a per-channel shift of an op's output, added to its folded bias
    # (``b * s + t + shift``): one side of a sum whose operands trade their
    # offsets (`Plan.balanced_sums`); the other side's is its negation.
    shifts: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # op id -> (second rounding's noise over the int8 output's) for each output a
    # rule planned float (`Rule.float_outputs`) that stays int8 at its alternative
    # spec: the dynamic-range kernel's second rounding of its input would cost
    # more (`odmlq.scales._outputs`). Those ops read their input as it is.
    int8_outputs: dict[str, float] = dataclasses.field(default_factory=dict)

    def input_scale(self, plan, op, edge_id: str) -> TensorScale | None:
        """The scale `op` reads input `edge_id` at: a conversion's, or the edge's."""
        edge_id = plan.graph.resolve(edge_id)
        target = op_qtype(plan, op)
        if target is not None and (edge_id, target.qtype) in self.conversions:
            return self.conversions[(edge_id, target.qtype)]
        return self.edges.get(edge_id)


def compute_scales(plan, calibration: Calibration | None, params: Any, *,
                   weight_scales: Mapping[str, TensorScale] | None = None,
                   quantized: Mapping[str, Any] | None = None) -> Scales:
    """Scale and zero point of every quantized edge, weight and bias of `plan`.

    Weights whose spec names an algorithm (`odmlq.GPTQ`) are rounded here too,
    against the calibration's statistics of their inputs (`Scales.weight_values`).

    Args:
      weight_scales: the weights' scales when they are already known (from
        quantized params, see `odmlq.quantize_params`); `params` is then read
        only for values derived from them by arithmetic that the plan
        quantizes where they are read (`WeightPlan.read_as`), and, with
        `quantized`, for the float weights bias correction compares with.
      quantized: with `weight_scales`, parameter path -> the weight's
        rounded values (its QArray dequantized), `params` holding the float
        weights: the ops whose algorithm asks for bias correction
        (``GPTQ(bias_correction=True)``) get their shifts as when the
        weights are rounded here. Without it those shifts are not applied.

    Raises:
      CalibrationError: a static edge has no statistics in `calibration`, or
        its scale is not finite, zero, or absurd (over `MAX_EDGE_SCALE`); a
        weight's algorithm finds no statistics of its inputs.
      PlanError: one parameter is given two different specs by two ops.
    """
    conversions: dict[tuple[str, str], TensorScale] = {}
    shifts, balanced = balance_shifts(plan, calibration)
    if weight_scales is None:
        folded = flat_params(fold_params(plan.graph, params, plan.weight_specs()))
        searched = clip_searched(plan, _weight_scales(plan, folded), folded, calibration)
    edges = edge_scales(plan, calibration, conversions, balanced,
                        searched if weight_scales is None else weight_scales)
    kept = int8_outputs(plan, calibration, folded if weight_scales is None else _float_weights(plan, params),
                        edges, _calibrated_scale)
    check_edge_scales(plan, edges, conversions)
    scales = Scales(edges=edges, weights={}, biases={}, constants={}, conversions=conversions, int8_outputs=kept)
    weight_values: dict[str, np.ndarray] = {}
    if weight_scales is None:
        weights = bias_room(plan, scales, searched, folded, params)
        weight_values = rounded_weights(plan, folded, weights, calibration,
                                        lambda op, edge: scales.input_scale(plan, op, edge))
        for op_id, correction in bias_corrections(plan, folded, weight_values, calibration).items():
            shifts[op_id] = shifts.get(op_id, 0) + correction
    else:
        weights = dict(weight_scales)
        if quantized:  # the weights' rounded values: their bias corrections as the export computes them
            folded = flat_params(fold_params(plan.graph, params, plan.weight_specs()))
            for op_id, correction in bias_corrections(plan, folded, quantized, calibration).items():
                shifts[op_id] = shifts.get(op_id, 0) + correction
    scales = dataclasses.replace(scales, weights=weights)
    biases, op_biases = _bias_scales(plan, scales, weights)
    constants = _constant_scales(plan, edges)
    derived = _derived_scales(plan, params, edges)
    return dataclasses.replace(scales, biases=biases, constants=constants, op_biases=op_biases,
                               derived=derived, weight_values=weight_values, shifts=shifts)


def _float_weights(plan, params: Any) -> Mapping[str, Any]:
    """The weights as the export folds them, where `params` holds them in float
    (empty where a weight is given quantized: a QArray has no float value)."""
    if params is None or any(isinstance(x, QArray) for x in jax.tree_util.tree_leaves(
            params, is_leaf=lambda x: isinstance(x, QArray))):
        return {}
    return flat_params(fold_params(plan.graph, params, plan.weight_specs()))


def folded_weights(graph, params: Any, scales: Scales) -> Any:
    """`params` as the quantized weights are made from them: each folded
    BatchNorm in its kernel (`odmlq.graph.fold_params`), and each weight an
    algorithm rounded replaced by its rounded values (`Scales.weight_values`)."""
    folded = fold_params(graph, params, scales.weights)
    return replace_params(folded, scales.weight_values) if scales.weight_values else folded


def _derived_scales(plan, params: Any, edges: Mapping[str, TensorScale]) -> dict[tuple[str, int], TensorScale]:
    """Scales of derived operands read as constants, from their values (one
    float run: they depend on parameters only)."""
    wanted: dict[str, list[tuple[int, Any]]] = {}
    for op in plan.graph.ops:
        weights = iter(plan.ops[op.id].weights)
        for index, operand in enumerate(op.operands):
            if operand.role in ("weight", "bias"):
                w = next(weights)
                if w.read_as is not None:
                    wanted.setdefault(op.id, []).append((index, w.read_as))
    if not wanted:
        return {}
    if params is None:
        raise PlanError(
            "This plan quantizes values derived from parameters where ops read them "
            f"({', '.join(sorted(wanted))}); compute_scales needs the float params for them.")
    params = jax.tree_util.tree_map(lambda x: x.dequantize() if isinstance(x, QArray) else x, params,
                                    is_leaf=lambda x: isinstance(x, QArray))
    values = operand_values(plan.graph, params, set(wanted))
    return {(op_id, index): _zero_at_output(plan, op_id, values[op_id][index], spec.qtype, edges)
            or constant_scale(values[op_id][index], spec.qtype)
            for op_id, items in wanted.items() for index, spec in items}


def _zero_at_output(plan, op_id: str, value, qtype, edges: Mapping[str, TensorScale]) -> TensorScale | None:
    """An operand all zeros (a freshly initialized table, or a constant bias
    folded from a mask of ones) read at its op's output scale, where the op
    writes one per-tensor scale of its qtype: any scale holds zeros exactly,
    and the default of 1 (a zero range) broke LiteRT's ADD, whose multiplier
    from an input of scale 1 to a fine output was over 1 (an abort loading
    BEiT's file at int16, and transformers' encoder-decoders' cross-attention
    biases: `litert/_multipliers`)."""
    op = plan.graph.op(op_id)
    output = edges.get(op.outputs[0]) if len(op.outputs) == 1 else None
    if (output is None or output.qtype != qtype or output.scale_axes or value is None
            or np.any(np.asarray(value) != 0)):
        return None
    return reshaped(output, np.ndim(value))


def _weight_scales(plan, values: Mapping[str, Any]) -> dict[str, TensorScale]:
    out: dict[str, TensorScale] = {}
    for param, spec in plan.weight_specs().items():
        if param not in values:
            raise PlanError(f"The params have no {param!r}, which the plan quantizes.")
        out[param] = weight_scale(np.asarray(values[param], np.float32), spec)
    return out


def weight_scale(x: np.ndarray, spec) -> TensorScale:
    shape = scale_shape(x.shape, spec.scale_axes, spec.block_axis, spec.block_size)
    if spec.block_size is not None:
        # Split the block axis into (blocks, block_size) and keep the block index.
        a, b = spec.block_axis, spec.block_size
        keep = tuple(ax if ax < a else ax + 1 for ax in spec.scale_axes) + (a,)
        lo, hi = range_of(spec.calibration, x, spec.qtype, symmetric=spec.symmetric,
                          keep_axes=tuple(sorted(keep)), block=(a, b))
    else:
        lo, hi = range_of(spec.calibration, x, spec.qtype, symmetric=spec.symmetric,
                          keep_axes=spec.scale_axes)
    return tensor_scale(spec, lo, hi, shape)


def _constant_scales(plan, edges: Mapping[str, TensorScale]) -> dict:
    out: dict[tuple[str, int], TensorScale] = {}
    for op in plan.graph.ops:
        specs = plan.ops[op.id].constants
        shared = len(op.outputs) == 1 and isinstance(plan.edges[op.outputs[0]].constraint, SharedWithInputs)
        for index, (operand, spec) in enumerate(zip(op.constants, specs)):
            if spec is None:
                continue
            output = edges.get(op.outputs[0]) if len(op.outputs) == 1 else None
            if shared and output is not None and output.qtype == spec.qtype and not output.scale_axes:
                # The kernel reads the constant at the output's scale, like its inputs.
                out[(op.id, index)] = reshaped(output, len(operand.shape))
            elif (zero := _zero_at_output(plan, op.id, operand.value, spec.qtype, edges)) is not None:
                out[(op.id, index)] = zero  # (a cross-attention's bias of zeros, folded from a mask of ones)
            else:
                out[(op.id, index)] = constant_scale(_saturating(plan, op, operand.value, edges), spec.qtype)
    return out


def _saturating(plan, op, value, edges: Mapping[str, TensorScale]):
    """A constant too large for its kernel's rescaling, cut to what still
    saturates the output, so the quantized result is the same and the
    kernel's fixed-point multipliers stay in range (LiteRT aborted loading
    a file with BART's causal-mask ADD of ``finfo.min``):

    - a MUL's multiplier (a mask's ``1e30 * (1 - m)``): half what saturates
      the output from one step of the input, so every input of two steps or
      more still saturates (a mask's 1 is the whole range) and the kernel's
      rescaling is 1/2: LiteRT's int16 MUL shifts its int32 product of two
      codes left by a rescaling's exponent, and a rescaling of 2 wrapped it
      (65535 LSB off, DistilBERT's mask at int16);
    - an ADD's or SUB's term (an additive mask folded to a constant): twice
      the output's largest magnitude plus the input's, so every input still
      saturates.
    """
    inputs = [plan.graph.resolve(e) for e in op.inputs]
    if op.kind not in ("mul", "add", "sub") or len(inputs) != 1 or len(op.outputs) != 1 or value is None:
        return value
    x, y = edges.get(inputs[0]), edges.get(op.outputs[0])
    if x is None or y is None or x.scale_axes or y.scale_axes:
        return value
    if op.kind == "mul":
        bound = 0.5 * _largest(y) / float(np.max(x.scale))
    else:
        bound = 2.0 * _largest(y) + _largest(x)
    v = np.asarray(value, np.float64)
    return np.clip(v, -bound, bound) if np.max(np.abs(v)) > bound else value


def _largest(ts: TensorScale) -> float:
    """The largest magnitude a per-tensor quantized tensor holds."""
    zero = 0.0 if ts.zero_point is None else float(np.max(ts.zero_point))
    return float(np.max(ts.scale)) * max(abs(ts.qtype.qmin - zero), abs(ts.qtype.qmax - zero))


def _bias_scales(plan, scales: Scales, weights) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Int32 bias scales by parameter path, and those of folded ops by op id
    (their bias is computed from the folded BatchNorm, not read from a parameter)."""
    out: dict[str, np.ndarray] = {}
    folded: dict[str, np.ndarray] = {}
    for c in int32_bias_ops(plan, scales):
        bias_scale = (np.asarray(weights[c.kernel].scale).reshape(-1) * c.input_scale).astype(np.float32)
        if c.fold:
            folded[c.op.id] = bias_scale
        else:
            out.update({b.param: bias_scale for b in c.biases})
    return out, folded


def fake_quant_bias(x: jax.Array, scale: np.ndarray) -> jax.Array:
    """What an int32 bias with this per-channel scale holds, in float."""
    # In XLA, whose float32 division is not numpy's (26% of quotients differ
    # in the last bit on this host): the same in an export and in simulate.
    s = jnp.asarray(scale).reshape((1,) * (jnp.ndim(x) - 1) + (-1,)) if jnp.ndim(x) else scale
    q = jnp.clip(jnp.round(x / s), -_INT32_MAX, _INT32_MAX)
    return q * s


def quantized_params(params: Any, scales: Scales,
                     transform: Callable[[str, Any, TensorScale], Any] | None = None) -> Any:
    """`params` with every quantized weight fake-quantized (or `transform`ed) and
    every int32 bias rounded to its grid."""
    values = flat_params(params)
    new = {}
    for path, ts in scales.weights.items():
        new[path] = transform(path, values[path], ts) if transform else ts.fake_quant(values[path])
    for path, s in scales.biases.items():
        new[path] = fake_quant_bias(jnp.asarray(values[path]), s)
    return replace_params(params, new)
