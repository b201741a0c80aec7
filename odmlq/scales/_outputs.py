"""Which float outputs stay float (`Rule.float_outputs`), decided from calibration.

A float output is written by a dynamic-range kernel that reads an int8 edge and
rounds it again, to a grid of each row's own range, at run time. Where the
model's output loses more to its input's rounding than to its own, that second
rounding costs more than the int8 output would: a classifier reading a few
features whose int8 steps are coarse next to the logits' (measured: a ViT and a
MobileNetV3-like CNN lost 1.4 and 1.3 dB with float outputs). Per output
channel j, the second rounding adds at most ``||w_j||^2 s_in^2 / 12`` of noise
(a row's step is at most the edge's ``s_in``), the int8 output ``s_out^2 / 12``
(its calibrated step). The output stays int8, at its alternative spec
(`EdgePlan.alternative`), where the first, averaged over channels, is at least
the second.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from odmlq.errors import CalibrationError
from odmlq.graph import MOVES_VALUES
from odmlq.scales._tensor import TensorScale

__all__ = ["int8_outputs"]


def int8_outputs(plan, calibration, values: Mapping[str, Any], edges: dict[str, TensorScale],
                 calibrated_scale) -> dict[str, float]:
    """op id -> the estimate (second rounding's noise over the int8 output's) of each
    float output kept int8; their edges' scales are added to `edges`.
    `calibrated_scale(edge, spec, calibration)` gives a static edge's scale."""
    if calibration is None:
        return {}
    chains: dict[str, list[str]] = {}
    for edge_id, edge_plan in plan.edges.items():
        if edge_plan.spec is None and edge_plan.alternative is not None and plan.graph.edges[edge_id].alias is None:
            chains.setdefault(_writer(plan.graph, edge_id), []).append(edge_id)
    kept: dict[str, float] = {}
    graph = plan.graph
    for writer, chain in chains.items():
        ratio = _estimate(plan, writer, values, edges, calibration, calibrated_scale)
        if ratio is None or ratio < 1.0:
            continue
        kept[writer] = ratio
        for edge_id in chain:  # the same values (reshaped, transposed): the same range
            edges[edge_id] = calibrated_scale(graph.edges[edge_id], plan.edges[edge_id].alternative, calibration)
    for edge_id, edge in graph.edges.items():
        if edge.alias is not None and graph.resolve(edge_id) in edges and edge_id not in edges:
            edges[edge_id] = edges[graph.resolve(edge_id)]
    return kept


def _writer(graph, edge_id: str) -> str:
    """The op computing `edge_id`'s values, before any op that only moves them."""
    op = graph.op(graph.edges[edge_id].producer)
    while op.kind in MOVES_VALUES and op.inputs and graph.edges[graph.resolve(op.inputs[0])].producer is not None:
        op = graph.op(graph.edges[graph.resolve(op.inputs[0])].producer)
    return op.id


def _estimate(plan, writer: str, values, edges, calibration, calibrated_scale):
    op = plan.graph.op(writer)
    data = next((o for o in op.operands if o.role == "input"), None)
    weight = next((o for o in op.operands if o.role == "weight"), None)
    if data is None or weight is None or not weight.contraction_axes or weight.param not in values:
        return None
    into = edges.get(plan.graph.resolve(data.edge))
    own = plan.graph.resolve(op.outputs[0])
    if into is None or plan.edges[own].alternative is None:
        return None  # a float input: no second rounding of an int8 edge
    try:
        scale = calibrated_scale(plan.graph.edges[own], plan.edges[own].alternative, calibration)
        matrix = np.asarray(values[weight.param], np.float64)
    except (CalibrationError, TypeError, ValueError):
        return None  # no statistics of the alternative, or a weight given quantized: stays float
    if matrix.ndim != len(weight.shape):
        return None
    norms = np.sum(matrix ** 2, axis=tuple(weight.contraction_axes))
    s_in, s_out = float(np.max(into.scale)), float(np.max(scale.scale))
    return float(np.mean(norms)) * s_in ** 2 / s_out ** 2
