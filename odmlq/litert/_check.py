"""LiteRT's check of a plan before any work: what its kernels cannot honour.

`check_plan` runs first in `export_tflite` (and in the report's advice): a
weight or activation type without a LiteRT kernel, per-block or per-channel
activation scales, mixed activation types a kernel cannot read, and the
integer interface's types. Each refusal names the op, its module and rule,
and what to change.
"""

from __future__ import annotations

from odmlq.constraints import SharedWithInputs
from odmlq.errors import OdmlqError, PlanError
from odmlq.litert.spec import OP_SPEC, SAME_AS_INPUT, TARGET, WITHOUT_KERNEL, requantized_from_producer
from odmlq.plan import Plan, op_qtype

__all__ = ["BLOCKWISE_KERNEL", "FloatOpsError", "blockwise_weights", "check_io_dtype", "check_plan"]

# XNNPACK's blockwise kernel (int4 weights, float16 block scales, inputs
# quantized to int8 per call), which LiteRT reaches from a FULLY_CONNECTED.
BLOCKWISE_KERNEL = ("for the int4 weight of a dynamic-range matmul (FULLY_CONNECTED), in blocks of a multiple "
                    "of 32 along its input axis with one scale column per output channel")

_LITERT_WEIGHT_QTYPES = ("int8", "int4")
_LITERT_ACT_QTYPES = ("int8", "int16")


class FloatOpsError(OdmlqError, ValueError):
    """A full-integer export would run some ops in float."""


def _check_float32(plan: Plan) -> None:
    """A model that computes in bfloat16 or float16 (a Flax module built with
    dtype=jnp.bfloat16) is refused before any work: LiteRT computes in float32
    and integers, and litert-converter 0.5.0 fails on such ops ('tfl.batch_matmul'
    ... explicitly marked illegal), or they stay casts no integer kernel takes."""
    low = [e for e in plan.graph.edges.values() if e.dtype in ("bfloat16", "float16") and e.producer is not None]
    if low:
        module = plan.graph.op(low[0].producer).module_path
        more = f", as are {len(low) - 1} more edges" if len(low) > 1 else ""
        raise PlanError(
            f"Edge {low[0].id!r} (module {module!r}) is {low[0].dtype}{more}: the model computes in "
            f"{low[0].dtype}. LiteRT's kernels compute in float32 and integers; export the model "
            "built to compute in float32 (a Flax module's dtype=jnp.float32, or a transformers model's "
            "dtype=jnp.float32; its params can stay as they are).")


def check_plan(plan: Plan, *, allow_float_ops: bool = False) -> list[str]:
    """LiteRT's check of a plan, before any work: what it cannot honour.

    Returns the ops that will stay in float (allowed with `allow_float_ops`).

    Raises:
      PlanError: a decision LiteRT cannot honour (per-block or multi-axis
        weight scales, per-channel activations, a qtype without a LiteRT
        kernel), naming the op, the rule and what to change.
    """
    if TARGET.name not in plan.targets:
        raise PlanError(
            f"This plan was made for the targets {list(plan.targets) or 'none'}, so LiteRT's scale "
            "constraints (shared, fixed and same-as-input output scales, fused activations) are not "
            "in it; make it with odmlq.plan(model, rules, x, target='litert') or target='both' "
            "(the default).")
    _check_float32(plan)
    float_ops = []
    for op in plan.graph.ops:
        op_plan = plan.ops[op.id]
        where = f"op {op.id!r} (module {op.module_path!r}, rules[{op_plan.rule}])"
        for w in op_plan.weights:
            spec = w.spec
            if spec is None:
                continue
            if spec.qtype not in _LITERT_WEIGHT_QTYPES or (spec.qtype == "int4" and not spec.symmetric):
                raise PlanError(f"{where}: weight {w.param!r} is {spec.qtype}; LiteRT stores weights "
                                f"as {' or '.join(_LITERT_WEIGHT_QTYPES)}. Change weight_qtype.")
            if spec.block_size is not None:
                why = _blockwise_refusal(plan, op, w.param, spec)
                if why is not None:
                    raise PlanError(f"{where}: weight {w.param!r} has {spec.describe()}; LiteRT takes block "
                                    f"scales only {BLOCKWISE_KERNEL}, and {why}. Use PerChannel() (or "
                                    "PerTensor()) here.")
            elif op.kind == "gather" and spec.scale_axes and op_qtype(plan, op) is not None:
                raise PlanError(f"{where}: table {w.param!r} has {spec.describe()}; LiteRT's GATHER_ND "
                                "writes its rows at the table's one scale, so a table gathered into a "
                                "quantized edge is quantized per tensor. Use weight_granularity=PerTensor() "
                                "for this module.")
            elif len(set(spec.scale_axes) - {0 for o in op.operands if o.param == w.param and o.stacked_axes == (0,)}) > 1:
                raise PlanError(f"{where}: weight {w.param!r} has {spec.describe()}; LiteRT takes one "
                                "scale per tensor or per output channel. Use PerChannel() or PerTensor().")
            if spec.qtype == "int4" and op.kind == "gather":
                # litert-converter 0.5.0 keeps the rows an int4 table's GATHER_ND reads int4 and
                # fails at their first reader (GATHER_ND or SELECT_V2 in transformers' GPT-2
                # and BERT), naming no op of the plan.
                readers = sorted({o.module_path for o in plan.graph.ops
                                  if any(r.param == w.param for r in plan.ops[o.id].weights)})
                modules = readers[0] if len(readers) == 1 else "(" + "|".join(readers) + ")"
                raise PlanError(f"{where}: table {w.param!r} is int4; LiteRT has no int4 gather, so its rows "
                                "would stay int4 where the next op reads them. Give it weight_qtype='int8' with a "
                                f"rule before this one (e.g. Rule({modules!r}, weight_qtype='int8')"
                                + (", one rule for every op reading it" if len(readers) > 1 else "")
                                + "), or keep it float (skip=True).")
            if spec.qtype == "int4" and op.kind == "conv" and op_plan.dynamic_input is not None:
                # ai-edge-litert 2.3.0 fails at the first invoke: 'Type FLOAT32
                # with filter type INT4 not currently supported' (DEPTHWISE_CONV_2D).
                raise PlanError(f"{where}: weight {w.param!r} is int4 in a dynamic-range convolution; LiteRT's "
                                "hybrid convolution kernels read int8 filters only (an int4 one fails at run "
                                "time). Give convolutions weight_qtype='int8' (e.g. Rule(..., op='conv', "
                                "weight_qtype='int8', act_qtype='int8', act_dynamic=True) before this rule), "
                                "or use int4 weights with a static or weight-only schema.")
        if op.kind == "scan":
            _check_loop(plan, op, where)
        _check_one_activation_type(plan, op, where)
        read = [e for e in op.inputs if plan.edges[e].spec is not None and not plan.edges[e].spec.dynamic]
        if read and op.outputs and not any(plan.graph.edges[e].is_float for e in op.outputs):
            # GREATER, ARG_MAX...: litert-converter 0.5.0 runs them on the
            # dequantized input (measured, Q/DQ on every input).
            dtypes = sorted({plan.graph.edges[e].dtype for e in op.outputs})
            message = (f"{where} reads quantized {read[0]!r} and writes {', '.join(dtypes)}; LiteRT has no "
                       f"integer kernel for {op.kind!r} (litert-converter 0.5.0 runs comparisons and "
                       "ARG_MAX on dequantized values). Pass allow_float_ops=True to run it in float")
            if not allow_float_ops:
                raise FloatOpsError(message + ".")
            float_ops.append(op.id)
        for edge_id in op.outputs:
            spec = plan.edges[edge_id].spec
            if spec is None:
                continue
            if spec.qtype not in _LITERT_ACT_QTYPES:
                raise PlanError(f"{where}: output {edge_id!r} is {spec.qtype}; LiteRT activations are "
                                f"{' or '.join(_LITERT_ACT_QTYPES)}. Change act_qtype.")
            # LiteRT's hybrid kernels quantize a dynamic input per batch row (a
            # matmul's: per row of the leading axes, its contracted trailing ones
            # flattened, as FULLY_CONNECTED reads a (B, T, heads, head dim) input
            # of Flax's DenseGeneral): those per-channel forms are what they compute.
            rows = tuple(range(len(spec.scale_axes)))
            if spec.scale_axes and not (spec.dynamic and tuple(spec.scale_axes) == rows):
                raise PlanError(f"{where}: output {edge_id!r} is per-channel; LiteRT activations "
                                "are per-tensor (dynamic ones may be per batch row, PerChannel(0)). Use "
                                "act_granularity=PerTensor().")
            if spec.dynamic:
                if spec.qtype != "int8":
                    raise PlanError(f"{where}: dynamic output {edge_id!r} is {spec.qtype}; LiteRT's "
                                    "dynamic-range kernels quantize activations to int8.")
                continue
            if spec.qtype == "int16" and not spec.symmetric:
                raise PlanError(f"{where}: int16 output {edge_id!r} must be symmetric (LiteRT's "
                                "16x8 kernels take zero point 0). Remove act_symmetric=False.")
            if casts_from_integers(plan.graph, op):
                # CAST writes float from integers (a mask, positions): its
                # output is quantized where it is read, as a model input is.
                continue
            limitation = _kernel_limitation(op, spec.qtype, plan.graph)
            if limitation is not None:
                if not allow_float_ops:
                    raise FloatOpsError(f"{where}: {limitation}.")
                float_ops.append(op.id)
                continue
            kind_spec = OP_SPEC.get(op.kind)
            fused = any(plan.edges[e].fused_into == op.id for e in op.inputs)  # the producer's kernel applies it
            if op.kind != "scan" and not fused and (kind_spec is None or spec.qtype not in kind_spec.schemas):
                why = (WITHOUT_KERNEL.get(op.kind) if kind_spec is None
                       else (kind_spec.refused or {}).get(spec.qtype))
                message = (f"{where}: LiteRT has no {spec.qtype} kernel for {op.kind!r}"
                           + (f" ({why})" if why else "")
                           + f"; keep it in float with Rule({op.module_path!r}, op={op.kind!r}, skip=True) "
                           "before the rule that matched it, and allow_float_ops=True"
                           + _from_integers_note(plan, op))
                if not allow_float_ops:
                    raise FloatOpsError(message + ".")
                float_ops.append(op.id)
    return float_ops


def _check_loop(plan: Plan, op, where: str) -> None:
    """A loop is unrolled into the file (its int16 per-step outputs joined by
    PADs and ADDs: `Annotation.stacked`); a layer-stacked weight is sliced into
    one tensor per layer, each with its layer's scales (`_stacked`), where the
    loop reads it one layer per step along its first axis, per channel."""
    for o in (o for o in plan.graph.ops if o.region == op.id):
        for w in plan.ops[o.id].weights:
            operand = next((x for x in o.operands if x.param == w.param and x.stacked_axes), None)
            if w.spec is None or operand is None:
                continue
            if operand.stacked_axes != (0,) or w.spec.block_size is not None:
                why = ("its blocks" if w.spec.block_size is not None
                       else f"a stack along axes {list(operand.stacked_axes)} (only along the first)")
                raise PlanError(f"{where}: weight {w.param!r} stacks layers along a loop axis (nn.scan); the "
                                f"LiteRT export slices such a weight into one tensor per layer, but not {why}. "
                                "Give it per-channel scales (a rule for its module with "
                                "weight_granularity=odmlq.PerChannel()), write the layers as a Python loop (one "
                                "module each), or keep the loop in float with Rule(<its module>, skip=True) and "
                                "allow_float_ops=True.")


def _kernel_limitation(op, qtype: str, graph) -> str | None:
    """Why LiteRT's kernel for the op's kind cannot run this op with `qtype`
    activations (see `spec.OpSpec.limitation`), or None."""
    check = getattr(OP_SPEC.get(op.kind), "limitation", None)
    return None if check is None else check(op, qtype, graph)


def _check_one_activation_type(plan: Plan, op, where: str) -> None:
    """LiteRT kernels read and write one activation type (an int8 -> int16
    FULLY_CONNECTED computes garbage, without an error): an input of another
    qtype is read through a conversion (`Plan.conversions`, a QUANTIZE op;
    after a same-scale separator where the converter would fold it into the
    producer: `requantized_from_producer`). Kernels that read every input at
    their output's scale (CONCATENATION, MAXIMUM, MINIMUM) have litert-converter
    fold the QUANTIZE and their requantization into one, so the conversion
    writes their output's grid; refused where it cannot (another op reads the
    same conversion, or that grid has a scale per axis)."""
    converted = [c for c in plan.conversions.values() if op.id in c.consumers]
    for c in converted:
        producer = plan.graph.edges[c.edge].producer
        kind = None if producer is None else plan.graph.op(producer).kind
        if requantized_from_producer(plan, c) and plan.edges[c.edge].spec.scale_axes:
            raise PlanError(
                f"{where} reads {c.source} edge {c.edge!r} as {c.spec.qtype}; the edge has a scale per "
                f"axis {plan.edges[c.edge].spec.scale_axes}, and LiteRT's requantization of it would be "
                f"folded into the producing {kind!r} op (computed wrongly). Give the producer "
                f"({producer!r}) act_qtype={c.spec.qtype!r} too, or one scale per tensor.",
                ops=(op.id, producer))
        if c.source == "float" and kind is not None:
            _check_float_layout_between(plan, op, plan.graph.op(producer), c, where)
    output = plan.edges[op.outputs[0]] if len(op.outputs) == 1 else None
    if output is not None and output.spec is not None and isinstance(output.constraint, SharedWithInputs):
        # The conversion writes this op's grid (`scales._edges._share_with_inputs`)
        # where this op alone reads it and that grid is one scale.
        per_axis = bool(output.spec.scale_axes)
        shared = [c for c in converted if per_axis or c.consumers != (op.id,)]
        if shared:
            c = shared[0]
            why = ("its output has a scale per axis" if per_axis else "the conversion is read by "
                   + ", ".join(repr(o) for o in c.consumers if o != op.id) + " too")
            raise PlanError(
                f"{where} reads {c.source} edge {c.edge!r} as {c.spec.qtype}; LiteRT's {op.kind} reads "
                f"its inputs at its output's scale, so the conversion must write that scale, and {why}. "
                "Give the producer of that edge and this op the same act_qtype.",
                ops=tuple(o for o in (op.id, plan.graph.edges[c.edge].producer) if o is not None))


def _check_float_layout_between(plan: Plan, op, layout, c, where: str) -> None:
    """A float op that only moves values (RESHAPE, TRANSPOSE: LiteRT runs them
    at their input's scale) between an edge of one qtype and a reader of
    another is no separator: litert-converter folds DEQUANTIZE, the op and
    QUANTIZE into a requantization of the edge's producer, which then writes
    the reader's qtype and scale (measured on MiniLM: an int16 value
    projection given the int8 attention matmul's scale, refused by
    verification)."""
    if getattr(OP_SPEC.get(layout.kind), "output", None) is not SAME_AS_INPUT or plan.edges[layout.outputs[0]].spec:
        return
    source = plan.graph.resolve(layout.inputs[0]) if layout.inputs else None
    spec = None if source is None else plan.edges[source].spec
    inner = None if source is None else plan.graph.edges[source].producer
    if spec is None or spec.dynamic or inner is None or spec.qtype == c.spec.qtype:
        return
    raise PlanError(
        f"{where} reads {c.spec.qtype} through a float {layout.kind!r} ({layout.id!r}) of {spec.qtype} edge "
        f"{source!r}: litert-converter folds the dequantize, {layout.kind} and quantize into the producing "
        f"op ({inner!r}), which then writes {c.spec.qtype} at this op's scale. Give {layout.id!r} and its "
        "producer one act_qtype, or keep the producer in float (skip=True, allow_float_ops=True).",
        ops=(op.id, layout.id, inner))


def check_io_dtype(plan: Plan, io_dtype: str) -> None:
    """Integer model inputs and outputs carry their edges' own type: LiteRT's
    interface rewrite cannot turn an int8 edge into an int16 input."""
    graph = plan.graph
    for kind, edges in (("input", graph.inputs), ("output", graph.outputs)):
        for edge_id in edges:
            edge_id = graph.resolve(edge_id)
            spec = plan.edges[edge_id].spec
            if not graph.edges[edge_id].is_float:
                continue  # token ids and other integer inputs stay as they are
            if spec is None or spec.qtype != io_dtype:
                have = "float" if spec is None else spec.qtype.name
                producer = graph.edges[edge_id].producer
                dynamic = (kind == "output" and spec is None and producer is not None
                           and plan.ops[producer].dynamic_input is not None)
                raise PlanError(
                    f"io_dtype={io_dtype!r}, but the model's {kind} {edge_id!r} is {have} in the plan; "
                    f"integer inputs and outputs take their edge's type. Use io_dtype={have!r}"
                    + (f": a dynamic-range kernel writes it ({producer!r}, by rules[{plan.ops[producer].rule}]); "
                       f"for {io_dtype} outputs give that op a static rule without float_outputs "
                       "(odmlq.FULL_INTEGER_INT8)"
                       if dynamic else "" if spec is None else
                       f" or 'float': the plan carries it in {have} for a convolution after the float ops "
                       "that read it (see plan.edges); or quantize the first op reading it"
                       if plan.edges[edge_id].reason.startswith("carried") else
                       f", or give that edge act_qtype={io_dtype!r}") + ".")


def blockwise_weights(plan: Plan) -> dict[str, tuple[str, int, int]]:
    """Parameter path -> (op id, input axis, output axis) of each blockwise
    weight the plan gives LiteRT's blockwise kernel (checked by `check_plan`)."""
    out = {}
    for op in plan.graph.ops:
        for w in plan.ops[op.id].weights:
            if w.spec is not None and w.spec.block_size is not None:
                operand = next(o for o in op.weights if o.param == w.param)
                out[w.param] = (op.id, operand.contraction_axes[0], operand.channel_axes[0])
    return out


def _blockwise_refusal(plan: Plan, op, param: str, spec) -> str | None:
    """Why LiteRT's blockwise kernel cannot take this weight, or None."""
    op_plan = plan.ops[op.id]
    operand = next(o for o in op.weights if o.param == param)
    if spec.qtype != "int4":
        return f"this weight is {spec.qtype}"
    if op.kind not in ("dot_general", "einsum"):
        return f"this op is a {op.kind!r}"
    if op_plan.dynamic_input is None or op_plan.dynamic_inputs_float:
        return "this op's inputs are not quantized per call (give its rule act_dynamic=True)"
    if len(operand.shape) != 2 or not operand.contraction_axes or not operand.channel_axes \
            or len(operand.channel_axes) != 1:
        return f"this weight has shape {tuple(operand.shape)} (a 2-D matrix is needed)"
    if spec.block_axis != operand.contraction_axes[0] or tuple(spec.scale_axes) != tuple(operand.channel_axes):
        return f"its blocks run along axis {spec.block_axis} (the input axis is {operand.contraction_axes[0]})"
    if spec.block_size % 32:
        return f"the block size is {spec.block_size}"
    return None


def casts_from_integers(graph, op) -> bool:
    """Whether `op` converts integer (or bool) activations to float: LiteRT's
    CAST, whose float output a QUANTIZE then quantizes like a model input."""
    return op.kind == "convert_element_type" and bool(op.inputs) and not any(
        graph.edges[graph.resolve(e)].is_float for e in op.inputs)


def _from_integers_note(plan, op) -> str:
    """For an op computing from integer model inputs only (a rotary embedding's
    SIN of positions): what keeping it in float gives."""
    graph = plan.graph
    seen, stack, inputs = set(), [graph.resolve(e) for e in op.inputs], set()
    while stack:
        edge = graph.edges[stack.pop()]
        if edge.id in seen:
            continue
        seen.add(edge.id)
        if edge.is_input or edge.producer is None:
            if edge.is_float or not edge.is_input:  # a float input, a loop's carry
                return ""
            inputs.add(edge.id)
            continue
        producer = graph.op(edge.producer)
        if producer.weights or producer.kind == "scan":
            return ""
        stack.extend(graph.resolve(e) for e in producer.inputs)
    if not inputs:
        return ""
    return (f" (it computes from the integer input(s) {', '.join(sorted(inputs))} and constants only: in float it "
            "is exact, the ops between it and those inputs run in float too, and its output is quantized "
            "where a quantized op reads it)")
