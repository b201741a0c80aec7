"""How far an exported tensor may be from simulate, in LSB of its edge (internal).

Verification feeds simulate the interpreter's own value of every edge the file
exposes, so an op is checked on its own inputs and its kernel's tolerance
applies (`odmlq.litert.spec.OpSpec.tolerance_lsb`). A loop is unrolled into
the file, each step's ops named by step, and checked and fed step by step
(`_mapping.map_steps`). Where a step has no tensor of an edge its reader
reads, simulate computes it again from the loop's inputs, through every step:
what each step's kernels may differ beyond rounding (an int16 TANH's 4 LSB)
then adds up, once per step (the bound: 1 + steps x 4 LSB). Rounding alone
(one LSB) is not multiplied.
"""

from __future__ import annotations

from odmlq.litert.spec import OP_SPEC


def allowed_lsb(plan, scales, edge_id: str, tolerance_lsb: float, slack: float, fed=frozenset()) -> float:
    """The largest difference allowed on `edge_id`: the verification's
    tolerance or its producer's kernel's, plus `slack` (float32 noise), plus,
    for each loop simulate runs again to compute it from the edges in `fed`,
    its length times its body's largest kernel tolerance."""
    qtype = scales.edges[edge_id].qtype
    allowed = max(tolerance_lsb, _kernel_lsb(plan, plan.graph.edges[edge_id].producer, qtype)) + slack
    for loop in loops_recomputed(plan, edge_id, fed):
        body = [o for o in plan.graph.ops if o.region == loop.id]
        per_step = max([_kernel_lsb(plan, o.id, _qtype(plan, o)) for o in body], default=0.0)
        allowed += loop.attributes.get("length", 1) * per_step
    return allowed


def loops_recomputed(plan, edge_id: str, fed) -> list:
    """The loops between `edge_id` and the edges in `fed` (what simulate
    computes again for it)."""
    graph, loops, seen = plan.graph, [], set()
    pending = [graph.edges[graph.resolve(edge_id)].producer]
    while pending:
        op_id = pending.pop()
        if op_id is None or op_id in seen:
            continue
        seen.add(op_id)
        op = graph.op(op_id)
        if op.kind == "scan":
            loops.append(op)
        if op.region is not None and any(graph.resolve(e) not in fed for e in op.inputs):
            pending.append(op.region)  # a step's op (a loop's stacked output aliases one) not fed: its loop
        pending += [graph.edges[graph.resolve(e)].producer for e in op.inputs if graph.resolve(e) not in fed]
    return loops


def _kernel_lsb(plan, op_id, qtype) -> float:
    if op_id is None or qtype is None:
        return 0.0
    op = plan.graph.op(op_id)
    spec = OP_SPEC.get(op.kind)
    allowed = ((spec and spec.tolerance_lsb) or {}).get(str(qtype), 0.0)
    per_element = ((spec and spec.tolerance_lsb_per_element) or {}).get(str(qtype))
    shape = plan.graph.edges[op.inputs[0]].shape if per_element and op.inputs else None
    if shape:
        allowed = max(allowed, per_element * shape[-1])
    return allowed


def _qtype(plan, op):
    spec = plan.edges[op.outputs[0]].spec if op.outputs else None
    return None if spec is None else spec.qtype
