"""Plan passes over edges that follow from how kernels work (internal).

- An activation a matmul, convolution or elementwise kernel applies before
  requantizing its result (relu, relu6) is fused: the tensor between them is
  never materialized, so it is not quantized.
- Run-time (dynamic) quantization happens inside matmul/conv kernels, so a
  dynamic edge that feeds anything else stays float.
"""

from __future__ import annotations

import dataclasses

from odmlq.graph import Graph
from odmlq.quant_spec import QuantSpec

# Activations that matmul/conv kernels apply before requantizing their int32
# accumulators (LiteRT's fused_activation_function, XLA fusion): the tensor
# between the op and the activation is never materialized, so it is not
# quantized; the activation's output carries the quantization.
FUSED_ACTIVATIONS = frozenset({"relu", "relu6"})
# Ops that apply a following activation before requantizing (LiteRT's
# FULLY_CONNECTED, CONV_2D, ADD, SUB, MUL all take a fused activation).
FUSING_OPS = frozenset({"dot_general", "conv", "einsum", "add", "sub", "mul"})


def fuse_activations(graph: Graph, by_edge: dict) -> None:
    for op in graph.ops:
        if op.kind not in FUSING_OPS or len(op.outputs) != 1:
            continue
        edge = graph.edges[op.outputs[0]]
        if edge.is_output or len(edge.consumers) != 1 or by_edge[edge.id].spec is None:
            continue
        consumer = graph.op(edge.consumers[0])
        if consumer.kind in FUSED_ACTIVATIONS and by_edge[consumer.outputs[0]].spec is not None:
            by_edge[edge.id] = dataclasses.replace(by_edge[edge.id], spec=None,
                                                   reason=f"fused into {consumer.id}")


KERNELS = frozenset({"dot_general", "conv", "einsum"})


def dynamic_only_into_kernels(graph: Graph, by_edge: dict) -> None:
    """Run-time quantization happens inside matmul/conv kernels (dynamic-range
    kernels quantize their input per call): a dynamic edge is quantized where
    a kernel reads it (`dynamic_kernel_inputs`), and read in float by anything
    else; an edge no kernel reads stays float."""
    for edge in graph.edges.values():
        plan = by_edge.get(edge.id)
        if plan is None or plan.spec is None or not plan.spec.dynamic:
            continue
        if not any(graph.op(c).kind in KERNELS for c in edge.consumers):
            by_edge[edge.id] = dataclasses.replace(
                plan, spec=None, reason="dynamic: only inputs of matmul/conv are quantized at run time")


def dynamic_kernel_inputs(plan) -> dict[str, list]:
    """op id -> [(operand index, spec)]: the dynamic edges each matmul/conv
    kernel quantizes at run time (other consumers read them in float)."""
    out: dict[str, list] = {}
    for op in plan.graph.ops:
        if op.kind not in KERNELS:
            continue
        index_of_rule = plan.ops[op.id].rule
        rule = None if index_of_rule is None else plan.rules[index_of_rule]
        own = (None if rule is None or rule.skip or not rule.act_dynamic or rule.act_qtype is None
               else QuantSpec(qtype=rule.act_qtype, symmetric=rule.resolved("act_symmetric"), dynamic=True))
        for index, operand in enumerate(op.operands):
            if operand.role != "input":
                continue
            edge_id = plan.graph.resolve(operand.edge)
            edge_plan = plan.edges[edge_id]
            spec = edge_plan.spec
            if spec is None and own is not None and plan.graph.edges[edge_id].is_float \
                    and not edge_plan.fused:
                # A float edge (from an op kept in float) read by a dynamic
                # kernel: the kernel quantizes it, as its rule says.
                spec = own
            if spec is not None and spec.dynamic:
                out.setdefault(op.id, []).append((index, spec))
    return out
