"""Input conversions: an op reads every activation input in its own qtype.

An op computes in the qtype of its output (an int16 ADD reads int16, an int8
FULLY_CONNECTED reads int8). When a rule gives an op another activation qtype
than the producer of one of its inputs (int16 residual adds between int8
matmuls, an int8 matmul after a LayerNorm kept in float), that input is
requantized where the op reads it: one conversion per (edge, qtype), shared by
every consumer of that qtype. Its range is the source's whole representable
range (an integer edge: nothing clips) or the edge's calibrated range (a float
edge), its symmetry the consumer's rule's (int16 is symmetric on LiteRT). On LiteRT a conversion is a QUANTIZE op (int8 <-> int16, or float ->
int after a float island); `odmlq.simulate` fake-quantizes the value the op
reads, so every backend computes the same numbers.

Not converted: inputs that are not float tensors (token ids), dynamic edges
(their kernels quantize at run time), inputs of ops that stay in float or
that a target computes in float only (`OpPlan.inputs_float`), and
inputs already in the op's qtype. Internal; `Plan.conversions` is the API.
"""

from __future__ import annotations

import dataclasses

from odmlq.plan._spec import QuantSpec

__all__ = ["Conversion", "conversion_name", "input_conversion_scales", "input_conversions", "op_qtype"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Conversion:
    """Edge `edge` requantized to `spec.qtype` for the ops in `consumers`.

    Attributes:
      edge: the (alias-resolved) edge id whose value is converted.
      spec: the spec of the converted value (per tensor).
      consumers: the ops that read the converted value.
      source: the edge's own qtype, or 'float'.
    """

    edge: str
    spec: QuantSpec
    consumers: tuple[str, ...]
    source: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.edge, self.spec.qtype)

    @property
    def name(self) -> str:
        return conversion_name(self.edge, self.spec.qtype)

    def describe(self) -> str:
        return f"{self.source} -> {self.spec.describe()} for {', '.join(self.consumers)}"


def conversion_name(edge: str, qtype: str) -> str:
    """The name of edge `edge` converted to `qtype`: ``<edge>/to_<qtype>``, the
    scope LiteRT's QUANTIZE for it is named in (`odmlq.litert._annotate`) and the
    key simulate captures and is fed the converted value under."""
    return f"{edge}/to_{qtype}"


def op_qtype(plan, op) -> QuantSpec | None:
    """The static activation spec an op computes in (its output's, or that of
    the activation fused into it), or None (float, dynamic, no output)."""
    return computed_qtype(plan.graph, plan.edges, op)


def computed_qtype(graph, edges, op) -> QuantSpec | None:
    """`op_qtype` from the graph and its edge plans (while a plan is made)."""
    if op.kind == "scan" or len(op.outputs) != 1:
        return None
    edge = graph.edges[graph.resolve(op.outputs[0])]
    spec = edges[edge.id].spec
    if spec is None and edges[edge.id].fused:
        spec = edges[graph.resolve(graph.op(edge.consumers[0]).outputs[0])].spec
    if spec is None or spec.dynamic or spec.scale_axes:
        return None
    return spec


def input_conversions(plan) -> dict[tuple[str, str], Conversion]:
    """Every (edge, qtype) an op reads in another qtype than the edge has."""
    graph = plan.graph
    found: dict[tuple[str, str], Conversion] = {}
    for op in graph.ops:
        target = op_qtype(plan, op)
        if target is None or plan.ops[op.id].inputs_float:
            continue
        for edge_id in dict.fromkeys(op.inputs):
            edge_id = graph.resolve(edge_id)
            edge = graph.edges[edge_id]
            if not edge.is_float:
                continue
            source = plan.edges[edge_id].spec
            if source is not None and (source.dynamic or source.qtype == target.qtype):
                continue
            if source is None and plan.edges[edge_id].fused:
                continue  # never materialized: the fused activation's output is read
            key = (edge_id, target.qtype)
            if key in found:
                found[key] = dataclasses.replace(found[key], consumers=found[key].consumers + (op.id,))
                continue
            spec = QuantSpec(qtype=target.qtype, symmetric=target.symmetric,
                             calibration=(source or target).calibration)
            found[key] = Conversion(edge=edge_id, spec=spec, consumers=(op.id,),
                                    source="float" if source is None else source.qtype)
    return found


def input_conversion_scales(plan, scales) -> dict[str, list]:
    """op id -> [(operand index, TensorScale)] of the inputs it reads converted
    to its own qtype (`Plan.conversions`)."""
    if not scales.conversions:
        return {}
    out: dict[str, list] = {}
    for op in plan.graph.ops:
        target = op_qtype(plan, op)
        if target is None or plan.ops[op.id].inputs_float:
            continue
        for index, operand in enumerate(op.operands):
            if operand.role != "input":
                continue
            ts = scales.conversions.get((plan.graph.resolve(operand.edge), target.qtype))
            if ts is not None:
                out.setdefault(op.id, []).append((index, ts))
    return out
