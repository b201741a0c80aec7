"""Model outputs computed into float by dynamic-range kernels (`Rule.float_outputs`).

A full-integer model's output is the int8 rounding of its last op's int32 sums:
a step of 1/255 of the output's range, which caps its SQNR against float
whatever the rest of the model does (38.3 dB for the digits MLP's logits). A
matmul or convolution with quantized weights has a dynamic-range kernel
(LiteRT's hybrid FULLY_CONNECTED / CONV_2D, which XNNPACK runs in the same
partition as the int8 ops): it reads its int8 input edge, quantizes it again
per row at run time and writes float from its sums. Where a rule asks for
float outputs, the op writing a model output (through value-moving ops only:
`Graph.output_writers`) is planned so, and those ops' output edges stay float,
each with its static spec as the alternative (`EdgePlan.alternative`): calibrated,
and taken by `odmlq.compute_scales` where the kernel's second rounding of its
input would cost more than the int8 output (`odmlq.scales._outputs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from odmlq.graph import MATMUL_KINDS, MOVES_VALUES, Graph
from odmlq.plan._specs_of import dynamic_input_spec
from odmlq.rules import Rule

__all__ = ["FLOAT_OUTPUT_REASON", "float_output_ops", "floated"]

FLOAT_OUTPUT_REASON = ("float_outputs: a model output, written from the int32 sums of a dynamic-range kernel "
                       "reading an int8 edge, unless calibration keeps it int8 (Scales.int8_outputs)")


def float_output_ops(graph: Graph, rules: Sequence[Rule], op_plans: Mapping, *, rows: bool,
                     depthwise_float: bool, is_depthwise) -> dict[str, object]:
    """op id -> the dynamic input spec of each matmul/conv that writes a model output
    in float (None for the value-moving ops between it and the output).

    `depthwise_float`: a target runs no dynamic-range depthwise convolution on
    its delegate (LiteRT: outside XNNPACK, slower than float), so such an op
    keeps its int8 output.
    """
    out: dict[str, object] = {}
    for output in graph.outputs:
        if output not in graph.edges:
            continue
        chain, edge_id = [], graph.resolve(output)
        while True:
            producer = graph.edges[edge_id].producer
            if producer is None:
                break
            op = graph.op(producer)
            chain.append(op)
            if op.kind not in MOVES_VALUES or not op.inputs:
                break
            edge_id = graph.resolve(op.inputs[0])
        if not chain:
            continue
        writer = chain[-1]
        plan = op_plans[writer.id]
        rule = rules[plan.rule] if plan.rule is not None else None
        if (rule is None or not rule.float_outputs or writer.kind not in MATMUL_KINDS
                or not any(w.role == "weight" and w.spec is not None for w in plan.weights)
                or (depthwise_float and is_depthwise(writer))):
            continue
        as_dynamic = dataclasses.replace(rule, act_dynamic=True, act_calibration=None, float_outputs=False)
        out[writer.id] = dynamic_input_spec(writer, as_dynamic, rows)
        out.update({op.id: None for op in chain[:-1]})
    return out


def floated(graph: Graph, by_edge: dict, float_outputs) -> None:
    """The float-output ops' edges, planned as static (every pass applied), made
    float with that static spec as their alternative (`EdgePlan.alternative`)."""
    for edge in graph.edges.values():
        base = by_edge.get(edge.id)
        if edge.producer in float_outputs and base is not None and base.spec is not None:
            by_edge[edge.id] = dataclasses.replace(base, spec=None, alternative=base.spec, reason=FLOAT_OUTPUT_REASON,
                                                   constraint=None, fused_into=None)
