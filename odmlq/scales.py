"""Scales: the plan's specs turned into numbers.

`compute_scales(plan, calibration, params)` gives every quantized edge and
weight its scale and zero point: weights from their own values (with the
weight calibration method of their spec), edges from the calibration
statistics, biases of quantized matmuls and convolutions from the product of
their input and weight scales (int32, as integer kernels add them to the
int32 accumulator), constant operands of elementwise ops from their values
(`constant_scale`). Backends and `simulate` all quantize with the same
`Scales`, so their results line up value for value.

Where the plan's targets constrain an edge (`EdgePlan.constraint`, resolved
when the plan was made), its scale follows the constraint: its input's,
shared with the inputs of the op that reads it, or fixed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from odmlq.graph import flat_params, fold_params, operand_values, replace_params
from odmlq.plan import op_qtype
from odmlq.calibration import Calibration, range_of
from odmlq.constraints import FixedScale, SameAsInput, SharedWithInputs
from odmlq.errors import CalibrationError, PlanError
from odmlq.qarray import QArray, compute_scale, fake_quant, quantize, scale_shape
from odmlq.qtypes import QType, qtype as lookup_qtype

__all__ = ["TensorScale", "Scales", "compute_scales", "constant_scale", "flat_params"]

_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorScale:
    """How one tensor is quantized, with numbers: see `odmlq.qarray` for the shapes."""

    qtype: QType
    scale: np.ndarray
    zero_point: np.ndarray | None = None
    scale_axes: tuple[int, ...] = ()
    block_axis: int | None = None
    block_size: int | None = None
    narrow_range: bool = False
    rounding: str = "half_even"
    # For 'half_away': the output is an integer sum divided by this count; the
    # float value is snapped back onto that grid before rounding, so float32
    # noise cannot move a tie.
    divisor: int = 1

    def __post_init__(self):
        object.__setattr__(self, "qtype", lookup_qtype(self.qtype))

    def _kwargs(self) -> dict:
        return dict(scale=self.scale, zero_point=self.zero_point, scale_axes=self.scale_axes,
                    block_axis=self.block_axis, block_size=self.block_size,
                    narrow_range=self.narrow_range)

    def fake_quant(self, x: jax.Array) -> jax.Array:
        if self.rounding == "half_away" or self.divisor > 1:
            return _fake_quant_of_sum(x, self)
        return fake_quant(x, self.qtype, **self._kwargs())

    def quantize(self, x: jax.Array) -> QArray:
        return quantize(x, self.qtype, **self._kwargs())

    def lsb(self) -> np.ndarray:
        """One quantization step, in the tensor's float units."""
        return np.asarray(self.scale, np.float32)


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

    def input_scale(self, plan, op, edge_id: str) -> TensorScale | None:
        """The scale `op` reads input `edge_id` at: a conversion's, or the edge's."""
        edge_id = plan.graph.resolve(edge_id)
        target = op_qtype(plan, op)
        if target is not None and (edge_id, target.qtype) in self.conversions:
            return self.conversions[(edge_id, target.qtype)]
        return self.edges.get(edge_id)


def compute_scales(plan, calibration: Calibration | None, params: Any, *,
                   weight_scales: Mapping[str, TensorScale] | None = None) -> Scales:
    """Scale and zero point of every quantized edge, weight and bias of `plan`.

    Args:
      weight_scales: the weights' scales when they are already known (from
        quantized params, see `odmlq.quantize_params`); `params` is then read
        only for values derived from them by arithmetic that the plan
        quantizes where they are read (`WeightPlan.read_as`).

    Raises:
      CalibrationError: a static edge has no statistics in `calibration`, or
        its scale is not finite, zero, or absurd (over `MAX_EDGE_SCALE`).
      PlanError: one parameter is given two different specs by two ops.
    """
    if weight_scales is None:
        weights = _weight_scales(plan, flat_params(fold_params(plan.graph, params, plan.weight_specs())))
    else:
        weights = dict(weight_scales)
    conversions: dict[tuple[str, str], TensorScale] = {}
    edges = _edge_scales(plan, calibration, conversions)
    _check_edge_scales(plan, edges, conversions)
    scales = Scales(edges=edges, weights=weights, biases={}, constants={}, conversions=conversions)
    biases, op_biases = _bias_scales(plan, scales, weights)
    constants = _constant_scales(plan, edges)
    derived = _derived_scales(plan, params)
    return dataclasses.replace(scales, biases=biases, constants=constants, op_biases=op_biases,
                               derived=derived)


def _derived_scales(plan, params: Any) -> dict[tuple[str, int], TensorScale]:
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
    return {(op_id, index): constant_scale(values[op_id][index], spec.qtype)
            for op_id, items in wanted.items() for index, spec in items}


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
        blocked = x.reshape(x.shape[:a] + (x.shape[a] // b, b) + x.shape[a + 1:])
        keep = tuple(ax if ax < a else ax + 1 for ax in spec.scale_axes) + (a,)
        lo, hi = range_of(spec.calibration, blocked, spec.qtype, symmetric=spec.symmetric,
                          keep_axes=tuple(sorted(keep)))
    else:
        lo, hi = range_of(spec.calibration, x, spec.qtype, symmetric=spec.symmetric,
                          keep_axes=spec.scale_axes)
    return _tensor_scale(spec, lo, hi, shape)


def _tensor_scale(spec, lo, hi, shape) -> TensorScale:
    """The scale (and zero point) of `spec` for the float range [lo, hi]."""
    lo, hi = np.reshape(lo, shape), np.reshape(hi, shape)
    scale, zero_point = compute_scale(lo, hi, spec.qtype, symmetric=spec.symmetric,
                                      narrow_range=spec.narrow_range)
    return TensorScale(
        qtype=spec.qtype, scale=np.asarray(scale, np.float32),
        zero_point=None if zero_point is None else np.asarray(zero_point, np.int32),
        scale_axes=spec.scale_axes, block_axis=spec.block_axis, block_size=spec.block_size,
        narrow_range=spec.narrow_range)


def _edge_scales(plan, calibration, conversions) -> dict[str, TensorScale]:
    graph = plan.graph
    out: dict[str, TensorScale] = {}
    for edge_id, edge_plan in plan.edges.items():
        spec = edge_plan.spec
        edge = graph.edges[edge_id]
        if spec is None or spec.dynamic or edge.alias is not None:
            continue
        constraint = edge_plan.constraint
        if isinstance(constraint, FixedScale):
            shape = (1,) * len(edge.shape)
            out[edge_id] = TensorScale(qtype=spec.qtype, scale=np.full(shape, constraint.scale, np.float32),
                                       zero_point=np.full(shape, constraint.zero_point, np.int32))
            continue
        if isinstance(constraint, SameAsInput):
            same = _read_input_scale(plan, edge, spec, constraint, out, calibration, conversions)
            if same is not None:
                out[edge_id] = same
                continue
        out[edge_id] = _calibrated_scale(edge, spec, calibration, _resolution(plan, edge, out))
    for key in plan.conversions:
        _conversion_scale(plan, key, out, calibration, conversions)
    _share_with_inputs(plan, out)
    for edge_id, edge in graph.edges.items():
        target = graph.resolve(edge_id)
        if edge.alias is not None and target in out:
            out[edge_id] = out[target]
    return out


# An activation scale over this is no tensor's range but a sentinel's: an
# attention mask's finfo(float32).min (-3.4e38) or -1e9 reaching a calibrated
# edge. Every real value on that edge rounds to zero, and LiteRT kernels can
# overflow their fixed-point multipliers on it (seen: an abort while
# allocating a SOFTMAX whose input scale was 1.3e36).
MAX_EDGE_SCALE = 1e6


def _check_edge_scales(plan, edges: Mapping[str, TensorScale], conversions) -> None:
    graph = plan.graph
    found = [(edge_id, ts) for edge_id, ts in edges.items() if graph.edges[edge_id].alias is None]
    found += [(edge_id, ts) for (edge_id, _), ts in conversions.items()]
    for edge_id, ts in found:
        scale = np.asarray(ts.scale, np.float64)
        if np.all(np.isfinite(scale)) and np.all(scale > 0) and np.all(scale <= MAX_EDGE_SCALE):
            continue
        edge = graph.edges[edge_id]
        if edge.producer is not None:
            where = f"edge {edge_id!r} (op {edge.producer!r}, module {graph.op(edge.producer).module_path!r})"
        else:
            reader = edge.consumers[0] if edge.consumers else None
            where = f"edge {edge_id!r} (a model input" + ("" if reader is None else
                     f", read by op {reader!r}, module {graph.op(reader).module_path!r}") + ")"
        value = float(np.max(scale)) if np.all(np.isfinite(scale)) else "not finite"
        if isinstance(value, float) and value > MAX_EDGE_SCALE:
            raise CalibrationError(
                f"{where} gets the {ts.qtype} scale {value:.3g}: its calibrated range is dominated by a "
                "huge constant, such as an attention mask's finfo(float32).min or -1e9, and every real "
                "value would round to zero. Give the mask a finite bias (e.g. -30 where the scores "
                "are small), keep the op that adds it in float with a skip rule, or calibrate the edge "
                "with act_calibration=odmlq.FixedRange(lo, hi).")
        raise CalibrationError(
            f"{where} gets a {ts.qtype} scale that is {value if isinstance(value, str) else 'zero or negative'}; "
            "its calibration statistics are not usable (NaN or infinite values reached it, or a "
            "FixedRange is empty). Check the representative data, or calibrate the edge with "
            "act_calibration=odmlq.FixedRange(lo, hi).")


def _read_input_scale(plan, edge, spec, constraint, out, calibration, conversions) -> TensorScale | None:
    """The scale of the producer's first quantized input, as the op reads it
    (None: no per-tensor input of the same qtype; the edge is calibrated)."""
    graph = plan.graph
    producer = graph.op(edge.producer)
    source = next((e for e in producer.inputs if graph.resolve(e) in out), None)
    if source is None:
        return None
    key = (graph.resolve(source), spec.qtype)
    base = (_conversion_scale(plan, key, out, calibration, conversions)
            if key in plan.conversions else out[key[0]])
    if base.qtype != spec.qtype or base.scale_axes:
        return None
    shape = (1,) * len(edge.shape)
    return dataclasses.replace(
        base, rounding=constraint.rounding.value, divisor=producer.attributes.get("window_size", 1),
        scale=base.scale.reshape(shape),
        zero_point=None if base.zero_point is None else base.zero_point.reshape(shape))


def _conversion_scale(plan, key, edges, calibration, conversions) -> TensorScale:
    """The scale of a conversion (`Plan.conversions`), computed once into
    `conversions`. A quantized source's whole representable range is kept
    (int8 -> int16 then moves each value by at most half an int16 step, and
    nothing clips); a float source's range is its calibrated one."""
    if key not in conversions:
        conversion = plan.conversions[key]
        edge = plan.graph.edges[conversion.edge]
        source = edges.get(conversion.edge)
        if source is None or source.scale_axes:
            conversions[key] = _calibrated_scale(edge, conversion.spec, calibration)
        else:
            qt = source.qtype
            s = np.asarray(source.scale, np.float64).reshape(())
            zp = 0.0 if source.zero_point is None else float(np.asarray(source.zero_point).reshape(()))
            lo = np.float32((qt.qmin + (1 if source.narrow_range else 0) - zp) * s)
            hi = np.float32((qt.qmax - zp) * s)
            conversions[key] = _tensor_scale(conversion.spec, lo, hi, scale_shape(edge.shape, ()))
    return conversions[key]


def _share_with_inputs(plan, out: dict[str, TensorScale]) -> None:
    """Ops whose kernel reads every input at its output's scale (an output
    constrained `SharedWithInputs`) give that scale to each input edge they
    alone consume, where the producer can requantize to it (a free output or
    a model input) — as a converter does, folding the requantization into the
    producer. Other inputs keep their scale and are requantized by a separate
    op, which computes the same values. Ops are visited last to first, so
    chains (max then min, a clip) share one scale.
    """
    graph = plan.graph
    aliased = {e.alias for e in graph.edges.values() if e.alias is not None}
    for op in reversed(graph.ops):
        if len(op.outputs) != 1 or op.outputs[0] not in out:
            continue
        if not isinstance(plan.edges[op.outputs[0]].constraint, SharedWithInputs):
            continue
        target = out[op.outputs[0]]
        if target.scale_axes:
            continue
        for edge_id in dict.fromkeys(op.inputs):
            edge = graph.edges[edge_id]
            if (edge_id not in out or edge.alias is not None or edge_id in aliased or edge.is_output
                    or edge.consumers != (op.id,) or out[edge_id].qtype != target.qtype):
                continue
            if not isinstance(plan.edges[edge_id].constraint, (type(None), SharedWithInputs)):
                continue
            out[edge_id] = _reshaped(target, len(edge.shape))


def _reshaped(ts: TensorScale, ndim: int) -> TensorScale:
    """A per-tensor scale laid out for a tensor of `ndim` dimensions."""
    shape = (1,) * ndim
    return TensorScale(qtype=ts.qtype, scale=np.asarray(ts.scale).reshape(shape),
                       zero_point=None if ts.zero_point is None else np.asarray(ts.zero_point).reshape(shape),
                       narrow_range=ts.narrow_range)


def constant_scale(value: np.ndarray, qtype: str) -> TensorScale:
    """Per-tensor symmetric scale of a constant operand, from its value.

    A constant that a power-of-two scale holds exactly (0, 0.5, 3.0, values on
    a grid of 0.25) gets that scale and no error; any other gets
    ``max|value| / qmax`` (its largest magnitude exact, the rest rounded).

    Raises:
      PlanError: the constant is not finite.
    """
    qt = lookup_qtype(qtype)
    v = np.asarray(value, np.float64)
    shape = (1,) * v.ndim
    if not np.all(np.isfinite(v)):
        raise PlanError(f"A constant operand {v.tolist() if v.size <= 8 else v.shape} is not finite; "
                        "it cannot be quantized. Keep its op in float with a skip rule.")
    absmax = float(np.max(np.abs(v))) if v.size else 0.0
    scale = 1.0
    if absmax > 0:
        scale = 2.0 ** math.ceil(math.log2(absmax / qt.qmax))
        if not np.array_equal(v / scale, np.round(v / scale)):
            scale = float(np.asarray(compute_scale(np.float32(-absmax), np.float32(absmax), qt.name,
                                                   symmetric=True)[0]))
    return TensorScale(qtype=qt.name, scale=np.full(shape, scale, np.float32))


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
                out[(op.id, index)] = _reshaped(output, len(operand.shape))
            else:
                out[(op.id, index)] = constant_scale(operand.value, spec.qtype)
    return out



def _fake_quant_of_sum(x: jax.Array, ts: TensorScale) -> jax.Array:
    """Fake-quantizes an average of integers as the target kernel rounds it.

    ``x / scale`` is snapped back onto the grid of 1/`divisor` (float32 noise
    must not move a tie). 'half_away' rounds ``x / scale + zero_point`` half
    away from zero, as LiteRT's AVERAGE_POOL_2D divides its raw integer sum;
    'half_even' rounds ``x / scale`` half to even, then adds the zero point,
    as requantizing kernels (a depthwise convolution) do.
    """
    qt = ts.qtype
    s = jnp.asarray(ts.scale)
    zp = 0.0 if ts.zero_point is None else jnp.asarray(ts.zero_point, jnp.float32)
    v = jnp.round(x / s * ts.divisor) / ts.divisor
    if ts.rounding == "half_away":
        v = v + zp
        q = jnp.sign(v) * jnp.floor(jnp.abs(v) + 0.5)
    else:
        q = jnp.round(v) + zp
    q = jnp.clip(q, qt.qmin, qt.qmax)
    return ((q - zp) * s).astype(x.dtype)


# Ops whose integer output can take no value between multiples of a step set
# by their inputs' scales: a sum of integers times the input scale (divided by
# the count for a mean), a product of integers times the product of scales.
_RESOLUTION_KINDS = frozenset({"mean", "reduce_sum", "add", "sub", "mul", "square"})
# A calibrated grid is kept at most this much finer than that step.
_FINER_THAN_RESOLUTION = 64.0


def _resolution(plan, edge, out: Mapping[str, TensorScale]) -> float | None:
    """The step below which the producer's integer result cannot vary: the
    smallest input scale (divided by the count a mean averages), or None."""
    if edge.producer is None:
        return None
    op = plan.graph.op(edge.producer)
    if op.kind not in _RESOLUTION_KINDS:
        return None
    scales = [out[plan.graph.resolve(e)] for e in op.inputs if plan.graph.resolve(e) in out]
    scales = [float(np.min(ts.scale)) for ts in scales if not ts.scale_axes]
    if not scales or len(scales) != len(op.inputs):
        return None
    if op.kind == "square":
        return scales[0] ** 2
    if op.kind == "mul":
        return float(np.prod(scales)) if len(scales) == 2 else None
    step = min(scales)
    if op.kind == "mean":
        step /= max(1, int(np.prod(plan.graph.edges[op.inputs[0]].shape)) // max(1, int(np.prod(edge.shape))))
    return step


def _calibrated_scale(edge, spec, calibration, resolution: float | None = None) -> TensorScale:
    """The edge's calibrated scale. Given the `resolution` its producer's
    integer result has, a range so narrow that its grid would be far finer
    (a degenerate edge: the mean of a just-normalized tensor, all within one
    input LSB of zero) is widened to a grid `_FINER_THAN_RESOLUTION` times
    finer: on a finer one, float32 rounding in `simulate` (1e-9) is many LSBs
    and no backend computes the same integers."""
    if calibration is None or edge.id not in calibration:
        raise CalibrationError(
            f"Edge {edge.id!r} is quantized statically ({spec.describe()}) but the calibration "
            "has no statistics for it; run odmlq.calibrate(model, plan, rep_dataset) with this "
            "plan, or make its rule dynamic (act_dynamic=True)."
        )
    lo, hi = calibration.range(edge.id, spec.qtype, symmetric=spec.symmetric)
    if resolution is not None and not spec.scale_axes:
        qt = lookup_qtype(spec.qtype)
        width = resolution / _FINER_THAN_RESOLUTION * (qt.qmax - qt.qmin)
        lo, hi = float(np.min(lo)), float(np.max(hi))
        if hi - lo < width:
            center = 0.0 if spec.symmetric else (lo + hi) / 2
            lo, hi = min(lo, center - width / 2), max(hi, center + width / 2)
    return _tensor_scale(spec, lo, hi, scale_shape(edge.shape, spec.scale_axes))


def _bias_scales(plan, scales: Scales, weights) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Int32 bias scales by parameter path, and those of folded ops by op id
    (their bias is computed from the folded BatchNorm, not read from a parameter)."""
    out: dict[str, np.ndarray] = {}
    folded: dict[str, np.ndarray] = {}
    for op in plan.graph.ops:
        fold = bool(op.attributes.get("fold"))
        biases = [w for w in plan.ops[op.id].weights if w.role == "bias"]
        kernels = [w for w in plan.ops[op.id].weights if w.role == "weight" and w.spec is not None]
        if not (biases or fold) or len(kernels) != 1 or not op.inputs:
            continue
        source = scales.input_scale(plan, op, op.inputs[0])
        if source is None or source.scale_axes or kernels[0].spec.block_size:
            continue
        if kernels[0].spec.qtype.kind != "int":
            continue
        kernel = weights[kernels[0].param]
        if len(kernel.scale_axes) > 1:  # stacked layers: biases stay float for now
            continue
        w_scale = np.asarray(kernel.scale).reshape(-1)
        in_scale = float(np.asarray(source.scale).reshape(-1)[0])
        if fold:
            folded[op.id] = (w_scale * in_scale).astype(np.float32)
            continue
        for b in biases:
            out[b.param] = (w_scale * in_scale).astype(np.float32)
    return out, folded


def fake_quant_bias(x: jax.Array, scale: np.ndarray) -> jax.Array:
    """What an int32 bias with this per-channel scale holds, in float."""
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
