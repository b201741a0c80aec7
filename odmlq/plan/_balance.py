"""Offsets balanced across a sum: which pairs of ops may trade bias (internal).

A residual block with a projection shortcut (ResNet's ``conv -> BatchNorm``
on both branches) adds two quantized tensors, each the output of an op with
a per-channel bias. Their sum does not change if channel ``c`` of one gets
``+d_c`` and the other ``-d_c`` (for ``a - b``: both ``+d_c``). BatchNorm
leaves large per-channel offsets, and a per-tensor scale must span every
channel's offset: moving the offsets onto the branch that can carry them
narrows both ranges, and the int8 error of both edges with them (measured on
transformers' Flax ResNet: one such edge was a third of the output error).

`balanced_sums(plan)` (`Plan.balanced_sums`) names the pairs where this is
exact and every backend reads it the same way; `odmlq.calibrate` observes
their operands' per-channel ranges too (`odmlq.calibration.channel_key`),
`odmlq.scales` picks the shifts from them, and each op adds its shift to its bias
where the folded bias is computed (`odmlq.hooks`), so simulate, XLA and
LiteRT all compute the shifted op. A pair qualifies when:

- the sum is an ``add`` or ``sub`` of two edges of its own shape, whose
  kernel rescales each operand (not one that reads both at its own scale);
- each edge is the only output of a different op with a BatchNorm folded
  into its quantized kernel (`Op.attributes['fold']`) and an additive step
  or bias to carry the shift, with the same channel axis and count;
- each edge is read by the sum alone (never a model output), quantized
  statically per tensor with ``MinMax`` calibration (the shifted tensor's
  statistics are then exact from per-channel ones: `scales._balance`), with no scale constraint and
  not fused into an activation.
"""

from __future__ import annotations

import dataclasses

from odmlq.calibration import MinMax
from odmlq.constraints import SharedWithInputs

__all__ = ["BalancedSum", "balanced_sums"]


@dataclasses.dataclass(frozen=True)
class BalancedSum:
    """``sum = a + sign * b`` where op `ops[0]` makes `edges[0]` (a) and
    `ops[1]` makes `edges[1]` (b); channels along `axis` of both."""

    sum_op: str
    ops: tuple[str, str]
    edges: tuple[str, str]
    sign: float
    axis: int


def balanced_sums(plan) -> tuple[BalancedSum, ...]:
    """Every sum whose two operands may trade per-channel offsets (see module doc)."""
    graph = plan.graph
    found = []
    for op in graph.ops:
        if op.kind not in ("add", "sub") or len(op.inputs) != 2 or op.constants or len(op.outputs) != 1:
            continue
        a, b = op.inputs
        shape = graph.edges[op.outputs[0]].shape
        if a == b or graph.edges[a].shape != shape or graph.edges[b].shape != shape:
            continue
        out_plan = plan.edges.get(op.outputs[0])
        if out_plan is not None and isinstance(out_plan.constraint, SharedWithInputs):
            continue  # the kernel reads both operands at the sum's scale
        sides = [_side(plan, op.id, e) for e in (a, b)]
        if None in sides or sides[0][1] != sides[1][1] or sides[0][2] != sides[1][2]:
            continue
        found.append(BalancedSum(sum_op=op.id, ops=(sides[0][0], sides[1][0]), edges=(a, b),
                                 sign=1.0 if op.kind == "add" else -1.0, axis=sides[0][1]))
    return tuple(found)


def _side(plan, sum_op: str, edge_id: str) -> tuple[str, int, int] | None:
    """(producer op, channel axis, channels) of an operand that qualifies, or None."""
    graph = plan.graph
    edge = graph.edges[edge_id]
    if edge.alias is not None or edge.producer is None or edge.is_output or edge.consumers != (sum_op,):
        return None
    producer = graph.op(edge.producer)
    fold = producer.attributes.get("fold")
    if not fold or producer.outputs != (edge_id,):
        return None
    carries = any(o.role == "bias" for o in producer.operands) or any(
        kind in ("add", "sub") for kind, _, _ in fold["steps"])
    kernels = [w for w in plan.ops[producer.id].weights if w.role == "weight"]
    if not carries or len(kernels) != 1 or kernels[0].spec is None:
        return None
    edge_plan = plan.edges.get(edge_id)
    spec = None if edge_plan is None else edge_plan.spec
    if (spec is None or spec.dynamic or spec.scale_axes or edge_plan.constraint is not None
            or edge_plan.fused or not isinstance(spec.calibration, MinMax)):
        return None
    ndim = len(edge.shape)
    axis = fold["channel_axis"] % ndim if ndim else 0
    if fold["ndim"] != ndim:
        return None
    return producer.id, axis, edge.shape[axis]
