"""Activation edge scales (internal; `odmlq.scales.compute_scales` calls them).

Each statically quantized edge gets its scale from the plan's constraint on
it (fixed, the same as its input's, shared with the inputs of the op that
reads it) or from calibration; a degenerate calibrated range is widened to
a grid the producing integer kernel can compute on, and an absurd scale (a
mask sentinel calibrated as data) is refused before any backend runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from odmlq.constraints import FixedScale, SameAsInput, SharedWithInputs
from odmlq.errors import CalibrationError
from odmlq.qarray import scale_shape
from odmlq.qtypes import qtype as lookup_qtype
from odmlq.scales._tensor import TensorScale, reshaped, tensor_scale


def edge_scales(plan, calibration, conversions, balanced=None, weights=None) -> dict[str, TensorScale]:
    """Every static edge's scale; `balanced`: edge id -> its range once the
    plan's balanced sums shift it (`odmlq.scales._balance`); `weights`:
    parameter path -> its scale, for the outputs that keep a weight's scale
    (a table's gathered rows)."""
    graph = plan.graph
    balanced = balanced or {}
    # A state input (`Plan.state`) is calibrated as the output fed back as it.
    state = {source: graph.resolve(result) for source, result in plan.state}
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
            same = _read_input_scale(plan, edge, spec, constraint, out, calibration, conversions, weights or {})
            if same is not None:
                out[edge_id] = same
                continue
        if edge_id in balanced:
            out[edge_id] = tensor_scale(spec, *balanced[edge_id], scale_shape(edge.shape, spec.scale_axes))
            continue
        if edge_id in state:
            out[edge_id] = _calibrated_scale(graph.edges[state[edge_id]], plan.edges[state[edge_id]].spec,
                                             calibration)
            continue
        out[edge_id] = _calibrated_scale(edge, spec, calibration, _resolution(plan, edge, out))
    for key in plan.conversions:
        _conversion_scale(plan, key, out, calibration, conversions)
    _share_with_inputs(plan, out, conversions)
    _share_carries(plan, out)
    for edge_id, edge in graph.edges.items():
        target = graph.resolve(edge_id)
        if edge.alias is not None and target in out:
            out[edge_id] = out[target]
    _check_state(plan, out, state)
    return out


def _share_carries(plan, out: dict[str, TensorScale]) -> None:
    """A loop's carry and what its body writes to it on one grid: the next
    step reads that output as the carry (a LiteRT file unrolls the loop, and
    a requantization between the steps would fold into the op writing it).
    The grid covers both ranges where the writer's scale is free; a writer
    whose kernel fixes its scale (a tanh) gives the carry its own."""
    graph = plan.graph
    for loop in (op for op in graph.ops if op.kind == "scan"):
        for carry, _, written in loop.attributes.get("carries", ()):
            written = graph.resolve(written) if written is not None else None
            a, b = out.get(carry), out.get(written)
            if a is None or b is None or a.scale_axes or b.scale_axes or a.qtype != b.qtype:
                continue
            if plan.edges[written].constraint is None:
                b = tensor_scale(plan.edges[written].spec, *_joined_bounds(a, b), np.shape(b.scale))
                out[written] = b
            out[carry] = reshaped(b, len(graph.edges[carry].shape))


def _joined_bounds(a: TensorScale, b: TensorScale) -> tuple[float, float]:
    """The float range two per-tensor grids cover together."""
    def bounds(t):
        s = float(np.ravel(t.scale)[0])
        z = 0.0 if t.zero_point is None else float(np.ravel(t.zero_point)[0])
        low = -t.qtype.qmax if t.narrow_range else t.qtype.qmin
        return (low - z) * s, (t.qtype.qmax - z) * s

    (a_lo, a_hi), (b_lo, b_hi) = bounds(a), bounds(b)
    return min(a_lo, b_lo), max(a_hi, b_hi)


def _check_state(plan, out: Mapping[str, TensorScale], state: Mapping[str, str]) -> None:
    """Each state pair on one grid (the caller feeds the output back as the input)."""
    for source, result in state.items():
        a, b = out.get(source), out.get(result)
        if a is None and b is None:
            continue
        if a is not None and a.same_grid(b):
            continue
        writer = plan.graph.edges[result].producer
        raise CalibrationError(
            f"State input {source!r} and output {result!r} (written by {writer!r}) get different scales: "
            f"the output's is fixed by its op ({type(plan.edges[result].constraint).__name__}), not "
            "calibrated, so the state cannot cross calls on one grid. Quantize the state at the op "
            "that writes it (a select or dynamic_update_slice), or keep the pair float.")


# An activation scale over this is no tensor's range but a sentinel's: an
# attention mask's finfo(float32).min (-3.4e38) or -1e9 reaching a calibrated
# edge. Every real value on that edge rounds to zero, and LiteRT kernels can
# overflow their fixed-point multipliers on it (seen: an abort while
# allocating a SOFTMAX whose input scale was 1.3e36).
MAX_EDGE_SCALE = 1e6


def check_edge_scales(plan, edges: Mapping[str, TensorScale], conversions) -> None:
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


def _read_input_scale(plan, edge, spec, constraint, out, calibration, conversions, weights) -> TensorScale | None:
    """The scale of the producer's first quantized input, as the op reads it,
    or, where it reads no quantized activation, of its first quantized weight:
    an embedding table's gathered rows keep the table's grid, which LiteRT's
    GATHER_ND requires (any other output scale makes litert-converter
    requantize the whole table at every invoke). None: no per-tensor input
    of the same qtype; the edge is calibrated."""
    graph = plan.graph
    producer = graph.op(edge.producer)
    source = next((e for e in producer.inputs if graph.resolve(e) in out), None)
    if source is not None:
        key = (graph.resolve(source), spec.qtype)
        base = (_conversion_scale(plan, key, out, calibration, conversions)
                if key in plan.conversions else out[key[0]])
    else:
        table = next((w.param for w in plan.ops[producer.id].weights
                      if w.spec is not None and w.read_as is None and w.param in weights), None)
        if table is None:
            return None
        base = weights[table]
    if base.qtype != spec.qtype or base.scale_axes or base.block_size is not None:
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
    nothing clips); a float source's range is its calibrated one. A narrowing
    conversion (int16 -> int8) takes the calibrated range within the
    source's: int16 is symmetric, and its whole range on an int8 grid spends
    half the codes on values a one-sided edge never takes (a concatenation
    with a ReLU's output, fuzzed: 4 dB under the all-int8 export)."""
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
            spec = conversion.spec
            if lookup_qtype(spec.qtype).bits < qt.bits and calibration is not None and edge.id in calibration:
                seen = calibration.range(edge.id, spec.qtype, symmetric=spec.symmetric)
                lo, hi = max(lo, np.float32(np.min(seen[0]))), min(hi, np.float32(np.max(seen[1])))
            conversions[key] = tensor_scale(spec, lo, hi, scale_shape(edge.shape, ()))
    return conversions[key]


def _share_with_inputs(plan, out: dict[str, TensorScale], conversions: dict) -> None:
    """Ops whose kernel reads every input at its output's scale (an output
    constrained `SharedWithInputs`) give that scale to each input edge they
    alone consume, where the producer can requantize to it (a free output or
    a model input) — as a converter does, folding the requantization into the
    producer — and to each conversion they alone read (an int16 or float edge
    read by an int8 concatenation: its QUANTIZE writes the concatenation's
    grid, which is what litert-converter makes of a QUANTIZE followed by a
    requantization). Other inputs keep their scale and are requantized by a
    separate op, which computes the same values. Ops are visited last to
    first, so chains (max then min, a clip) share one scale.
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
            conversion = plan.conversions.get((graph.resolve(edge_id), target.qtype))
            if conversion is not None and op.id in conversion.consumers:
                if conversion.consumers == (op.id,):
                    conversions[conversion.key] = reshaped(target, len(graph.edges[conversion.edge].shape))
                continue
            chain = _free_chain(plan, edge_id, op.id, out, aliased, target)
            for e in chain:
                out[e] = reshaped(target, len(graph.edges[e].shape))


# Ops that move their input's integers (their output keeps the input's scale),
# through which litert-converter 0.5.0 carries a shared scale back to the
# producer that computes them.
_MOVING_KINDS = frozenset({"reshape", "squeeze", "transpose", "rev", "slice", "broadcast_in_dim", "gather"})


def _free_chain(plan, edge_id: str, reader: str, out, aliased, target) -> list[str]:
    """The edges that take the shared scale of `reader`'s output for its input
    `edge_id`: the edge itself where its producer is free to requantize (or it
    is a model input); through ops that only move integers, each read by the
    next alone (a transpose or flip before a concatenation), the whole chain up
    to such a producer; none where the chain reaches a constrained one."""
    graph, chain = plan.graph, []
    while True:
        edge = graph.edges[edge_id]
        if (edge_id not in out or edge.alias is not None or edge_id in aliased or edge.is_output
                or edge.consumers != (reader,) or out[edge_id].qtype != target.qtype):
            return []
        chain.append(edge_id)
        constraint = plan.edges[edge_id].constraint
        if isinstance(constraint, (type(None), SharedWithInputs)):
            return chain
        producer = graph.op(edge.producer) if edge.producer is not None else None
        moved = [] if producer is None else [e for e in producer.inputs if graph.edges[e].is_float]
        if (not isinstance(constraint, SameAsInput) or producer is None or producer.kind not in _MOVING_KINDS
                or len(moved) != 1):
            return []
        edge_id, reader = moved[0], producer.id  # (a gather's table: its indices are integers)


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
    return tensor_scale(spec, lo, hi, scale_shape(edge.shape, spec.scale_axes))
