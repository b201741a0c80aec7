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


def dynamic_only_into_kernels(graph: Graph, by_edge: dict) -> None:
    """Run-time quantization happens inside matmul/conv kernels (dynamic-range
    kernels quantize their input per call), so a dynamic edge that feeds
    anything else stays float."""
    for edge in graph.edges.values():
        plan = by_edge.get(edge.id)
        if plan is None or plan.spec is None or not plan.spec.dynamic:
            continue
        kinds = {graph.op(c).kind for c in edge.consumers}
        if not kinds or not kinds <= {"dot_general", "conv", "einsum"}:
            by_edge[edge.id] = dataclasses.replace(
                plan, spec=None, reason="dynamic: only inputs of matmul/conv are quantized at run time")
