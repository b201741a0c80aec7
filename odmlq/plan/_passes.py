"""Plan passes over edges: what the targets' kernels do to each edge (internal).

- A target whose matmul, convolution or elementwise kernel applies a
  following activation (relu, relu6) before requantizing its result fuses
  it: the tensor between them is never materialized, so it is not quantized
  (`EdgePlan.fused_into`).
- Run-time (dynamic) quantization happens inside matmul/conv kernels on
  every backend, so a dynamic edge that feeds anything else stays float.
- Each quantized edge gets the constraint its producer's kernel puts on its
  scale (`EdgePlan.constraint`), from the targets' tables.
- A float model input that only float ops read is carried in a target's
  `float_input_carrier` qtype where its converter needs a quantized input
  to fuse a later convolution.
- The activation a float op's kernel applies stays float with it
  (`float_activations`): its output is quantized once, for its readers.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from odmlq.calibration import MASK_SENTINEL, Capped, Masked, RelativeMSE
from odmlq.constraints import SameAsInput
from odmlq.graph import MATMUL_KINDS, Graph
from odmlq.plan._conversions import computed_qtype
from odmlq.plan._spec import QuantSpec
from odmlq.plan._specs_of import matmul_of_rows
from odmlq.rules import Rule
# Ops through which a mask's sentinel reaches the scores a softmax reads.
_MASK_CARRIERS = frozenset({"select_n", "add", "sub", "max", "min", "broadcast_in_dim", "reshape",
                            "transpose", "squeeze", "convert_element_type", "mul"})


# A smaller "minus infinity" than `MASK_SENTINEL`: ``(1.0 - mask) * -10000.0``, as
# BigBird and code written for float16 add it. It seeds a mask only where the op
# reads a value computed from the model's integer inputs (the mask itself).
MASK_PENALTY = 1e3


def calibrate_masks(graph: Graph, by_edge: dict) -> None:
    """Edges an attention mask's sentinel reaches are calibrated with `Masked`:
    the sentinel is no data, and masked positions sit at the bottom of the
    range (the top, for a positive sentinel), far enough below the scores
    that a softmax gives them zero.

    The sentinel's sign is followed from the constant that seeds it: a
    ``mul`` seeds with its constant's sign (a mask's ``1 - m`` is not
    negative), and a ``sub`` that subtracts a masked edge flips it. A
    constant of `MASK_SENTINEL` or more seeds wherever it is; one of
    `MASK_PENALTY` or more where the op reads a value computed from integer
    inputs only, and its edges leave out values of half its size or more."""
    integer = {e for e in graph.inputs if not graph.edges[graph.resolve(e)].is_float}
    masked: dict[str, tuple[bool, float]] = {}  # edge -> (its sentinels are positive, their least size)
    for op in graph.ops:
        inputs = [graph.resolve(e) for e in op.inputs]
        from_integers = bool(inputs) and all(e in integer for e in inputs)
        if from_integers and op.region is None and op.kind != "scan" and not op.weights:
            integer.update(graph.resolve(e) for e in op.outputs)
        reads_integers = any(e in integer for e in inputs)
        big, sentinel = [], MASK_SENTINEL
        for c in op.constants:
            if c.value is None or not np.size(c.value) or not str(c.dtype).startswith(("float", "bfloat")):
                continue
            value = np.asarray(c.value, np.float64)
            largest = float(np.max(np.abs(value)))
            if largest >= MASK_SENTINEL or (largest >= MASK_PENALTY and reads_integers):
                big.append(float(value.flat[np.argmax(np.abs(value))]))
                sentinel = min(sentinel, largest / 2)
        carried = [i for i, e in enumerate(inputs) if e in masked]
        if op.kind not in _MASK_CARRIERS or not (big or carried):
            continue
        if op.kind == "mul" and not big:
            continue  # a product of a masked edge with data: no sentinel of known sign
        if carried:
            positive = masked[inputs[carried[0]]][0]
            sentinel = min([sentinel] + [masked[inputs[i]][1] for i in carried])
            if op.kind == "sub" and carried == [1]:
                positive = not positive
            if op.kind == "mul" and big[0] < 0:
                positive = not positive
        else:
            positive = big[0] > 0 if op.kind == "mul" else False
        masked.update((e, (positive, sentinel)) for e in op.outputs)
    for edge_id, (positive, sentinel) in masked.items():
        plan = by_edge.get(edge_id)
        if plan is None or plan.spec is None or plan.spec.dynamic or isinstance(plan.spec.calibration, Masked):
            continue
        spec = dataclasses.replace(plan.spec, calibration=Masked(plan.spec.calibration, sentinel=sentinel,
                                                                 top=positive))
        by_edge[edge_id] = dataclasses.replace(plan, spec=spec, reason=plan.reason + "; masked")


def calibrate_norms(graph: Graph, by_edge: dict) -> None:
    """A norm's ``rsqrt(var + eps)`` (LayerNorm, RMSNorm: `graph/_norms`) is
    calibrated with `Capped` at ``1/sqrt(2 eps)``: rows whose variance is
    under the norm's own eps have centered values of (near) zero, so their
    factor is read by nothing and must not set the range; the rest with
    `RelativeMSE`, since the factor's relative error is the normalized
    output's (rows of small variance would otherwise take the range)."""
    for op in graph.ops:
        if op.kind != "rsqrt" or len(op.inputs) != 1:
            continue
        producer = graph.edges[graph.resolve(op.inputs[0])].producer
        add = graph.op(producer) if producer is not None else None
        eps = [float(np.asarray(c.value).reshape(())) for c in (add.constants if add is not None else ())
               if c.value is not None and np.size(c.value) == 1]
        if add is None or add.kind != "add" or len(eps) != 1 or not eps[0] > 0:
            continue
        plan = by_edge.get(op.outputs[0])
        if plan is None or plan.spec is None or plan.spec.dynamic or isinstance(plan.spec.calibration, (Capped, Masked)):
            continue
        cap = 1.0 / math.sqrt(2.0 * eps[0])
        spec = dataclasses.replace(plan.spec, calibration=Capped(cap, RelativeMSE()))
        by_edge[op.outputs[0]] = dataclasses.replace(
            plan, spec=spec, reason=plan.reason + f"; norm factor: relative error, rows of variance < eps={eps[0]:.3g} left out")


def fuse_activations(graph: Graph, by_edge: dict, constraints) -> None:
    """Marks the output of an op whose kernel applies the activation that
    alone consumes it (`constraints(op, qtype)` lists the fused kinds)."""
    for op in graph.ops:
        if len(op.outputs) != 1:
            continue
        edge = graph.edges[op.outputs[0]]
        plan = by_edge.get(edge.id)
        if edge.is_output or len(edge.consumers) != 1 or plan is None or plan.spec is None:
            continue
        consumer = graph.op(edge.consumers[0])
        out = by_edge.get(consumer.outputs[0]) if consumer.outputs else None
        if out is None or out.spec is None:  # a loop's outputs are aliases, planned last
            continue
        _, fuses = constraints(op, plan.spec.qtype)
        if consumer.kind in fuses:
            by_edge[edge.id] = dataclasses.replace(plan, spec=None, reason=f"fused into {consumer.id}",
                                                   fused_into=consumer.id)


FLOAT_ACTIVATION = "float: the activation its float producer's kernel applies"


def float_activations(graph: Graph, rules, op_plans: dict, constraints) -> dict:
    """`op_plans` with the activation that alone reads a float op's output
    (a convolution a skip rule keeps in float, a weight-only matmul) kept in
    float too, where the targets' kernel for that op applies it (relu, relu6);
    a dynamic-range kernel's output is float too.

    Quantized on its own, such an activation reads its input requantized at
    the input's range: after a BatchNorm folded into a convolution that range
    is many times the activation's (EfficientNet-Lite0's first depthwise
    convolution skipped: 17 LSB of the ReLU6's grid lost, 9.4 dB at the
    logits under the sample's int8 rules with float outputs). In float, the
    producer's kernel applies it and its output is quantized once at its own
    range, where its readers read it."""
    out = dict(op_plans)
    for op in graph.ops:
        plan = op_plans[op.id]
        rule = rules[plan.rule] if plan.rule is not None else None
        if len(op.outputs) != 1 or not (rule is None or plan.skip or rule.act_qtype is None
                                        or rule.act_dynamic):
            continue
        edge = graph.edges[graph.resolve(op.outputs[0])]
        if edge.is_output or not edge.is_float or len(edge.consumers) != 1:
            continue
        consumer = graph.op(edge.consumers[0])
        reader = op_plans[consumer.id]
        reader_rule = rules[reader.rule] if reader.rule is not None else None
        if (reader_rule is None or reader.skip or reader_rule.act_qtype is None or reader_rule.act_dynamic
                or consumer.kind not in constraints(op, reader_rule.act_qtype)[1]):
            continue
        out[consumer.id] = dataclasses.replace(reader, skip=True)
    return out


def resolve_output_constraints(graph: Graph, by_edge: dict, constraints) -> None:
    """Gives each statically quantized, per-tensor edge its producer's constraint."""
    for edge in graph.edges.values():
        plan = by_edge.get(edge.id)
        if (plan is None or plan.spec is None or plan.spec.dynamic or plan.spec.scale_axes
                or edge.producer is None):
            continue
        constraint, _ = constraints(graph.op(edge.producer), plan.spec.qtype)
        if constraint is not None:
            by_edge[edge.id] = dataclasses.replace(plan, constraint=constraint)


def share_scale_of_activations_beside_others(graph: Graph, by_edge: dict, constraints) -> None:
    """An activation the producer's kernel would fuse, reading an edge that
    other ops read too, keeps its input's scale. litert-converter 0.5.0 fuses
    it anyway, into a duplicate of the producer that requantizes the
    accumulator straight to the activation's scale (one rounding, where a
    separate RELU rounds twice: 2 LSB apart); at the input's scale both
    round once, to the same integers."""
    for op in graph.ops:
        if len(op.outputs) != 1 or len(op.inputs) != 1:
            continue
        edge = graph.edges[graph.resolve(op.inputs[0])]
        source, out = by_edge.get(edge.id), by_edge.get(op.outputs[0])
        if (source is None or source.spec is None or source.spec.dynamic or out is None or out.spec is None
                or out.spec.dynamic or out.constraint is not None or edge.producer is None
                or len(edge.consumers) < 2 or out.spec.qtype != source.spec.qtype):
            continue
        _, fuses = constraints(graph.op(edge.producer), source.spec.qtype)
        if op.kind in fuses:
            by_edge[op.outputs[0]] = dataclasses.replace(
                out, constraint=SameAsInput(),
                reason=out.reason + f"; input's scale ({edge.producer} fuses it, duplicated)")


def dynamic_only_into_kernels(graph: Graph, by_edge: dict, float_readers: frozenset | set = frozenset()) -> None:
    """Run-time quantization happens inside matmul/conv kernels (dynamic-range
    kernels quantize their input per call): a dynamic edge is quantized where
    a kernel reads it (`dynamic_kernel_inputs`), and read in float by anything
    else; an edge no kernel reads stays float. `float_readers`: matmuls that
    read their inputs in float (`OpPlan.dynamic_inputs_float`: no target has
    a dynamic kernel for them)."""
    for edge in graph.edges.values():
        plan = by_edge.get(edge.id)
        if plan is None or plan.spec is None or not plan.spec.dynamic:
            continue
        if not any(graph.op(c).kind in MATMUL_KINDS and c not in float_readers for c in edge.consumers):
            by_edge[edge.id] = dataclasses.replace(
                plan, spec=None, reason="dynamic: only inputs of matmul/conv are quantized at run time")


def dynamic_kernel_inputs(plan, int8_outputs=()) -> dict[str, list]:
    """op id -> [(operand index, spec)]: the dynamic edges each matmul/conv
    kernel quantizes at run time (other consumers read them in float), and the
    float or static edges a kernel whose rule is dynamic reads. `int8_outputs`:
    ops planned to write float outputs that write int8 ones instead
    (`Scales.int8_outputs`): static kernels."""
    out: dict[str, list] = {}
    for op in plan.graph.ops:
        if op.kind not in MATMUL_KINDS or plan.ops[op.id].dynamic_inputs_float or op.id in int8_outputs:
            continue
        own = plan.ops[op.id].dynamic_input
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
            elif spec is not None and not spec.dynamic and own is not None:
                # A static edge read by a dynamic-range kernel (a classifier head
                # computed from an int8 edge into float outputs): the kernel reads
                # its values and quantizes them again at run time, per row.
                spec = own
            if spec is not None and spec.dynamic:
                if own is not None and own.scale_axes and not spec.scale_axes:
                    # An edge read by kernels that quantize it differently (a 1x1 convolution per
                    # pixel, a strided one per image): each kernel as it quantizes its own input.
                    spec = dataclasses.replace(spec, scale_axes=own.scale_axes)
                out.setdefault(op.id, []).append((index, spec))
    return out


def dynamic_per_row(graph: Graph, by_edge: dict) -> None:
    """A dynamic edge that only matmuls quantize (``dot_general``: LiteRT's
    hybrid FULLY_CONNECTED, which quantizes each row of its input with the
    row's own range) gets one range per row, every axis but the contracted
    ones, where its rule asks for one per tensor: every backend then computes
    what the kernel computes. So does the input of a 1x1 convolution that
    XNNPACK runs as a matmul over pixels (stride 1, unpadded, one group: each
    pixel quantized with its own range, measured). An edge another
    convolution also reads keeps its spec."""
    for edge in graph.edges.values():
        plan = by_edge.get(edge.id)
        if plan is None or plan.spec is None or not plan.spec.dynamic or plan.spec.scale_axes:
            continue
        rows = set()
        for consumer in edge.consumers:
            op = graph.op(consumer)
            if op.kind not in MATMUL_KINDS:
                continue  # read in float
            for operand in op.operands:
                if operand.role != "input" or operand.edge is None or graph.resolve(operand.edge) != edge.id:
                    continue
                contracted = operand.contraction_axes
                if op.kind == "conv" and op.attributes.get("pointwise") is not None:
                    contracted = (op.attributes["pointwise"],)  # a 1x1 convolution: a matmul over pixels
                elif not matmul_of_rows(op):
                    contracted = ()
                rows.add(tuple(a for a in range(len(operand.shape)) if a not in contracted) if contracted else None)
        if len(rows) == 1 and None not in rows:
            by_edge[edge.id] = dataclasses.replace(
                plan, spec=dataclasses.replace(plan.spec, scale_axes=rows.pop()),
                reason=plan.reason + "; per row, as the hybrid matmul kernel quantizes it")


# Op kinds LiteRT runs as convolutions (an int8 average pool is a depthwise
# convolution), which litert-converter fuses only after a quantized input.
_CONVOLUTION_KERNELS = ("conv", "avg_pool")


def _fused_only_after_a_quantized_input(graph: Graph, by_edge: dict, op) -> bool:
    """A statically quantized op that litert-converter 0.5.0 makes an integer
    kernel only where a quantized value precedes it, not after float ops
    reading the model's float input (it then keeps the op float, its weight
    dequantized and transposed at every invoke): a convolution, and a matmul
    whose weight has more than two axes (attention's query, key, value and
    output projections; a plain Dense is fused). A loop (nn.scan, unrolled
    into the file) counts for the ops in its body. Found by the fuzzer's mixed
    rules: a Dense kept float before a scan of attention blocks was refused."""
    if op.kind == "scan":
        return any(_fused_only_after_a_quantized_input(graph, by_edge, o) for o in graph.ops if o.region == op.id)
    if computed_qtype(graph, by_edge, op) is None:
        return False
    if op.kind in _CONVOLUTION_KERNELS:
        return True
    return op.kind == "dot_general" and any(w.role == "weight" and len(w.shape) > 2 for w in op.operands)


def carry_float_inputs(graph: Graph, by_edge: dict, qtype: str) -> None:
    """A float model input that only float ops read, with a statically
    quantized convolution downstream of them, is carried in `qtype`
    (`Target.float_input_carrier`): the float ops read it dequantized."""
    for edge in graph.edges.values():
        if not (edge.is_input and edge.is_float and edge.consumers) or by_edge[edge.id].spec is not None:
            continue
        seen, frontier = set(), list(edge.consumers)
        while frontier:
            op = graph.op(frontier.pop())
            if op.id in seen:
                continue
            seen.add(op.id)
            if _fused_only_after_a_quantized_input(graph, by_edge, op):
                spec = QuantSpec(qtype=qtype, symmetric=True, narrow_range=False,
                                 calibration=Rule(".*", act_qtype=qtype).resolved("act_calibration"))
                by_edge[edge.id] = dataclasses.replace(
                    by_edge[edge.id], spec=spec, rule=None,
                    reason=f"carried in {qtype} for {op.id}: a float input only float ops read "
                           "(litert-converter fuses a later convolution only so)")
                break
            frontier += [c for e in op.outputs for c in graph.edges[e].consumers]


FROM_INTEGERS = "float: computed from integer inputs only, and read only by float ops"


def float_from_integers(graph: Graph, op_plans: dict) -> set[str]:
    """Ops that compute from integer inputs and constants only (the CAST of a
    position input, the angles a rotary embedding divides it into) and are
    read only by float ops (its SIN and COS, kept float by a skip rule, or
    that a target runs in float only: `OpPlan.inputs_float`) run in float too, their
    constants float: their values are exact functions of the integers, and
    quantizing one before a float op only loses precision (an int8 angle is
    off by up to half of 1/127 of its range). Returns those ops; `op_plans` is
    updated (``skip``)."""
    integer = {e for e in graph.inputs if not graph.edges[graph.resolve(e)].is_float}
    derived: list = []
    for op in graph.ops:
        inputs = [graph.resolve(e) for e in op.inputs]
        if op.kind == "scan" or op.region is not None or op.weights or not inputs:
            continue
        if all(e in integer for e in inputs):
            integer.update(graph.resolve(e) for e in op.outputs)
            derived.append(op)
    made: set[str] = set()

    def is_float(op_id: str) -> bool:
        plan = op_plans[op_id]
        return op_id in made or plan.rule is None or plan.skip or plan.inputs_float

    for op in reversed(derived):
        outputs = [graph.edges[graph.resolve(e)] for e in op.outputs]
        if op_plans[op.id].skip or not any(e.is_float for e in outputs):
            continue
        if any(e.is_output for e in outputs) or not all(is_float(c) for e in outputs for c in e.consumers):
            continue
        op_plans[op.id] = dataclasses.replace(op_plans[op.id], skip=True,
                                              constants=(None,) * len(op_plans[op.id].constants))
        made.add(op.id)
    return made
