"""export_tflite: a Flax model to a verified full-integer LiteRT flatbuffer."""

from __future__ import annotations

import dataclasses
import inspect as pyinspect
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from odmlq.calibration import calibrate, calibrated_edges, needs_calibration
from odmlq.files import atomic_output, check_output_path
from odmlq.graph import check_finite_params, is_keras, keras_input_names, params_for
from odmlq.calibration import Calibration
from odmlq.errors import CalibrationError, OdmlqError, PlanError
from odmlq.litert import _annotate, _convert, _repair
from odmlq.litert._probe import LiteRTCrashError, probe
from odmlq.litert.inspect import ModelSummary, inspect
from odmlq.constraints import SharedWithInputs
from odmlq.litert.spec import OP_SPEC, TARGET, WITHOUT_KERNEL, pool_as_depthwise
from odmlq.progress import Stage
from odmlq.litert.verify import VerificationReport, verification_samples, verify as verify_model
from odmlq.plan import Plan, plan as make_plan
from odmlq.scales import Scales, compute_scales

__all__ = ["export_tflite", "Export", "FloatOpsError", "check_plan"]

_LITERT_WEIGHT_QTYPES = ("int8", "int4")
_LITERT_ACT_QTYPES = ("int8", "int16")


class FloatOpsError(OdmlqError, ValueError):
    """A full-integer export would run some ops in float."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Export:
    """What `export_tflite` made, and the evidence that it is right."""

    tflite: bytes
    path: str | None
    plan: Plan
    calibration: Calibration | None
    scales: Scales
    summary: ModelSummary
    verification: VerificationReport | None
    batch_size: int = 1

    def __str__(self) -> str:
        lines = [f"{self.path or '<bytes>'}: {len(self.tflite)} bytes, batch size {self.batch_size}, ops: "
                 + ", ".join(f"{k} x{v}" for k, v in self.summary.op_histogram.items()),
                 "float islands: " + (", ".join(f"{o.name} ({o.module_path})" for o in
                                                self.summary.float_islands) or "none")]
        if self.verification is not None:
            lines.append(str(self.verification))
        return "\n".join(lines)


SCHEMAS = ("static", "dynamic", "weight_only", "float")


def schema_of(plan: Plan) -> str:
    """Which LiteRT schema a plan asks for.

    - ``static``: activations quantized with calibrated ranges (full integer,
      int8 or int16x8);
    - ``dynamic``: int8 weights, activations quantized at run time by the
      kernels (dynamic-range);
    - ``weight_only``: quantized weights, float activations;
    - ``float``: nothing quantized.

    Raises:
      PlanError: static and dynamic activations mixed in one model.
    """
    specs = [p.spec for p in plan.edges.values() if p.spec is not None]
    static = [s for s in specs if not s.dynamic]
    dynamic = [s for s in specs if s.dynamic]
    if static and dynamic:
        raise PlanError(
            "The plan mixes static and dynamic activation quantization; a LiteRT model is "
            "either full integer or dynamic-range. Make every act rule static or every one dynamic."
        )
    if static:
        return "static"
    if dynamic:
        return "dynamic"
    weights = any(w.spec is not None for p in plan.ops.values() for w in p.weights)
    return "weight_only" if weights else "float"


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
            if spec.block_size is not None or len(spec.scale_axes) > 1:
                raise PlanError(f"{where}: weight {w.param!r} has {spec.describe()}; LiteRT takes one "
                                "scale per tensor or per output channel. Use PerChannel() or PerTensor().")
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
            # LiteRT's hybrid kernels quantize a dynamic input per batch row:
            # that one per-channel form is what they compute.
            if spec.scale_axes and not (spec.dynamic and tuple(spec.scale_axes) == (0,)):
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
                           + "; keep it in float with Rule(..., skip=True) and allow_float_ops=True")
                if not allow_float_ops:
                    raise FloatOpsError(message + ".")
                float_ops.append(op.id)
    return float_ops


def _kernel_limitation(op, qtype: str, graph) -> str | None:
    """Why LiteRT's kernel for the op's kind cannot run this op with `qtype`
    activations (see `spec.OpSpec.limitation`), or None."""
    check = getattr(OP_SPEC.get(op.kind), "limitation", None)
    return None if check is None else check(op, qtype, graph)


def export_tflite(model: Any, rules: Sequence | Plan, rep_dataset: Iterable | Callable | None,
                  path: str | os.PathLike | None = None, *, variables: Any = None,
                  example_inputs: Sequence[Any] | None = None,
                  calibration: Calibration | None = None, verify: bool = True,
                  verify_samples: int = 32, allow_float_ops: bool = False,
                  input_names: Sequence[str] | None = None,
                  output_names: Sequence[str] | None = None,
                  io_dtype: str = "float",
                  batch_size: int = 1,
                  progress: bool | None = None) -> Export:
    """Exports `model` as a LiteRT flatbuffer quantized by `rules`, and checks it.

    Args:
      model: a Linen module (pass `variables`) or an NNX module.
      rules: rules (or a ready Plan).
      rep_dataset: representative batches (iterable, or callable returning
        one). The last batch is held back from calibration and used to verify
        when there are two or more.
      path: where to write the .tflite (atomically; an existing file is
        replaced only by a complete new one). None: only return the bytes.
      example_inputs: inputs fixing the exported shapes (default: the first
        `batch_size` rows of the first batch).
      batch_size: the batch size of the exported model's inputs when
        `example_inputs` is not given (1 by default, as on a phone); the
        `Export` reports it.
      calibration: statistics to use instead of calibrating.
      verify: run the model in the LiteRT interpreter and check every op
        against `simulate` (within 1 LSB, or the op table's tolerance of an
        approximating kernel) — on by default — on up to `verify_samples`
        held-back rows and on perturbed copies of the first rows that no
        calibration range covers (x 1.5, and with noise).
      allow_float_ops: let ops without an integer kernel stay in float
        (listed and warned about) instead of failing.
      progress: bars on stderr while calibrating, converting and verifying
        (default: when stderr is a terminal; False: never).
      io_dtype: 'float' (the model quantizes its inputs and dequantizes its
        outputs) or 'int8' / 'int16' (the caller passes quantized tensors; the
        input and output scales are in the signature's tensors). Full-integer
        schemas only.

    The schema follows from the rules (see `schema_of`): calibrated int8 or
    int16 activations give a full-integer model; `act_dynamic=True` a
    dynamic-range one (int8 weights, activations quantized by the kernels at
    run time); weights alone a weight-only one (int8 or packed int4 weights
    dequantized for float kernels).

    Returns:
      An `Export` with the bytes, plan, scales, flatbuffer summary and
      verification report.

    Raises:
      PlanError, FloatOpsError: what LiteRT cannot do, before any work.
      CalibrationError: bad representative data.
      ConversionError: the converter failed (its diagnostic is kept).
      VerificationError: the converted model does not compute what the plan says.

    Example:
      >>> result = odmlq.export_tflite(model, [odmlq.Rule('.*', weight_qtype='int8',
      ...     act_qtype='int8')], batches, 'model.tflite', variables=variables)
      >>> print(result)
    """
    if path is not None:
        check_output_path(path)  # before any work
    params = params_for(model, variables, "export_tflite")
    check_finite_params(params)
    batches = list(rep_dataset() if callable(rep_dataset) else rep_dataset or [])
    if example_inputs is None:
        if not batches:
            raise PlanError("export_tflite needs example_inputs= or a non-empty rep_dataset.")
        first = batches[0] if isinstance(batches[0], (tuple, list)) else (batches[0],)
        for i, x in enumerate(first):
            kind = np.asarray(x).dtype.kind
            if kind in "biuf" and np.ndim(x) and np.shape(x)[0] == 0:
                raise CalibrationError(f"rep_dataset batch 0, input {i} is empty (shape {np.shape(x)}); "
                                       "give batches with at least one row.")
            if kind not in "biuf" or np.ndim(x) == 0:
                raise CalibrationError(
                    f"rep_dataset batch 0, input {i}: {type(x).__name__} of dtype {np.asarray(x).dtype} and "
                    f"shape {np.shape(x)}; each batch is an array (or a tuple of arrays, one per model "
                    "input) of numbers with the batch dimension first.")
        if not isinstance(batch_size, int) or batch_size < 1 or batch_size > int(np.shape(first[0])[0]):
            raise PlanError(f"batch_size={batch_size!r}: give an integer from 1 to the first batch's "
                            f"{int(np.shape(first[0])[0])} rows, or example_inputs= of the shape to export.")
        example_inputs = tuple(np.asarray(x)[:batch_size] for x in first)
    example_inputs = tuple(example_inputs)
    plan = (rules if isinstance(rules, Plan)
            else make_plan(model, rules, *example_inputs, variables=variables, target=TARGET))
    float_ops = check_plan(plan, allow_float_ops=allow_float_ops)
    schema = schema_of(plan)
    if io_dtype not in ("float", "int8", "int16"):
        raise PlanError(f"io_dtype={io_dtype!r}; choose 'float', 'int8' or 'int16'.")
    if io_dtype != "float" and schema != "static":
        raise PlanError(f"io_dtype={io_dtype!r} needs a full-integer model; this plan is {schema}.")
    if io_dtype != "float":
        _check_io_dtype(plan, io_dtype)
    held_back = batches[-1:] if len(batches) >= 2 else batches
    # Static edges need statistics (an empty rep_dataset is an error there);
    # weights rounded against their inputs (GPTQ, the default) use them where there is data.
    if calibration is None and (calibrated_edges(plan) or (batches and needs_calibration(plan))):
        calibration = calibrate(model, plan, batches[:-1] if len(batches) >= 2 else batches,
                                variables=variables, progress=progress)
    scales = compute_scales(plan, calibration, params)
    graph = plan.graph if plan.graph.program is not None else None
    if graph is None:
        graph = make_plan(model, plan.rules, *example_inputs, variables=variables, target=TARGET).graph
    fn = _annotate.annotated_function(graph, plan, scales, params, float_ops)
    names_in = list(input_names or _input_names(model, len(graph.inputs)))
    names_out = list(output_names or [f"output_{i}" for i in range(len(graph.outputs))])
    try:
        with Stage("converting", progress=progress):
            tflite = _convert.convert(fn, example_inputs, input_names=names_in, output_names=names_out,
                                      dynamic_range=schema == "dynamic")
    except _convert.ConversionError as error:
        raise _with_module_paths(error, plan) from error
    # litert-converter 0.5.0 writes an int32 bias for 16x8 convolutions, whose
    # kernels read int64 (outputs off by the whole range, or a depthwise
    # convolution refused at allocation): the bias is rewritten in the file.
    tflite = _repair.repair_int16_conv_bias(tflite, int32_bias_when_exact=True)
    if io_dtype != "float":
        tflite = _integer_interface(tflite, io_dtype)
    summary = inspect(tflite)
    _check_summary(schema, summary, allow_float_ops, float_ops)
    # Never write (or load here) a file that crashes LiteRT: a child process tries it first.
    try:
        probe(tflite, f"the model exported for {os.fspath(path)!r}" if path is not None else "the exported model")
    except LiteRTCrashError as error:
        raise LiteRTCrashError(f"{error}\nNothing was written.") from None
    report = None
    if verify:
        samples = verification_samples(held_back, verify_samples)
        report = verify_model(tflite, model, plan, scales, samples, variables=variables,
                              min_output_sqnr_db=_MIN_SQNR_DB.get(schema), progress=progress)
    written = _write_atomically(path, tflite) if path is not None else None
    return Export(tflite=tflite, path=written, plan=plan, calibration=calibration, scales=scales,
                  summary=summary, verification=report,
                  batch_size=int(np.shape(jax.tree_util.tree_leaves(example_inputs)[0])[0]))


# Models with float activations are checked end to end: LiteRT's float kernels
# and XLA's sum in other orders (float32 noise, ~100+ dB), and dynamic-range
# kernels quantize activations per batch row where simulate does per tensor.
#
# Full-integer models are checked op by op, and end to end as well: edges the
# converter merged away are not checked one by one, and a rewrite among them
# can change what the model computes while every checked op agrees (seen on a
# BERT encoder: every op within 1 LSB, outputs at 5.7 dB). One-LSB rounding
# differences between kernels and simulate stay far above 30 dB.
_MIN_SQNR_DB = {"weight_only": 60.0, "float": 60.0, "dynamic": 30.0, "static": 30.0}


def _with_module_paths(error, plan: Plan):
    """The converter's error, with the plan ops (and module paths) it names."""
    ops = []
    for location in error.locations:
        matches = [op for op in plan.graph.ops if location == op.id or location.startswith(op.id + "/")]
        if matches:
            op = max(matches, key=lambda o: len(o.id))
            ops.append(f"op {op.id!r} (module {op.module_path!r}, kind {op.kind!r})")
    where = "; ".join(dict.fromkeys(ops)) or "no op of the plan is named in the diagnostics"
    return _convert.ConversionError(f"{error}\nFailing: {where}.")


def _check_one_activation_type(plan: Plan, op, where: str) -> None:
    """LiteRT kernels read and write one activation type (an int8 -> int16
    FULLY_CONNECTED computes garbage, without an error): an input of another
    qtype is read through a conversion (`Plan.conversions`, a QUANTIZE op).
    Kernels that read every input at their output's scale (CONCATENATION,
    MAXIMUM, MINIMUM) would fold that QUANTIZE into their own scale, which the
    plan does not model: refused."""
    converted = [c for c in plan.conversions.values() if op.id in c.consumers]
    for c in converted:
        producer = plan.graph.edges[c.edge].producer
        kind = None if producer is None else plan.graph.op(producer).kind
        # An average pool lowered as a depthwise convolution requantizes too.
        requantizing = kind is not None and (plan.edges[c.edge].constraint is None or (
            kind == "avg_pool" and pool_as_depthwise(plan.graph.op(producer), c.source)))
        if c.source != "float" and requantizing:
            # Seen with FULLY_CONNECTED (its int8 output silently rescaled: 0 dB),
            # GELU ('input and output must have same element type') and the
            # depthwise pool ('output->type != data_type (INT16 != INT8)').
            raise PlanError(
                f"{where} reads {c.source} edge {c.edge!r} as {c.spec.qtype}: litert-converter 0.5.0 "
                f"folds that requantization into the producing {kind!r} op, which then reads "
                f"{c.source} and writes {c.spec.qtype} (computed wrongly or refused). Give the "
                f"producer ({producer!r}) act_qtype={c.spec.qtype!r} too, or keep it in float "
                "(skip=True, allow_float_ops=True): a QUANTIZE after a float op converts correctly.",
                ops=(op.id, producer))
    if converted and isinstance(plan.edges[op.outputs[0]].constraint, SharedWithInputs):
        c = converted[0]
        raise PlanError(
            f"{where} reads {c.source} edge {c.edge!r} as {c.spec.qtype}; LiteRT's {op.kind} reads "
            "its inputs at its output's scale, so the requantization cannot be placed before it. "
            "Give the producer of that edge and this op the same act_qtype.",
            ops=tuple(o for o in (op.id, plan.graph.edges[c.edge].producer) if o is not None))


def _check_io_dtype(plan: Plan, io_dtype: str) -> None:
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
                raise PlanError(
                    f"io_dtype={io_dtype!r}, but the model's {kind} {edge_id!r} is {have} in the plan; "
                    f"integer inputs and outputs take their edge's type. Use io_dtype={have!r}"
                    + ("" if spec is None else f", or give that edge act_qtype={io_dtype!r}") + ".")


def _integer_interface(tflite: bytes, io_dtype: str) -> bytes:
    """The model with int8/int16 inputs and outputs (no QUANTIZE/DEQUANTIZE at its ends)."""
    from ai_edge_litert import _pywrap_modify_model_interface as modify
    from ai_edge_litert import schema_py_generated as schema

    code = {"int8": schema.TensorType.INT8, "int16": schema.TensorType.INT16}[io_dtype]
    with tempfile.TemporaryDirectory(prefix="odmlq-") as tmp:
        src, dst = os.path.join(tmp, "in.tflite"), os.path.join(tmp, "out.tflite")
        with open(src, "wb") as f:
            f.write(tflite)
        if modify.modify_model_interface(src, dst, code, code) != 0:
            raise OdmlqError(f"Could not give the model {io_dtype} inputs and outputs "
                             "(LiteRT's modify_model_interface failed).")
        with open(dst, "rb") as f:
            return f.read()


def _check_summary(schema: str, summary: ModelSummary, allow_float_ops: bool, float_ops) -> None:
    static = schema == "static"
    slow = summary.weight_dequantize_or_transpose_at_run_time
    if schema == "weight_only":  # dequantizing the weights is what weight-only means
        slow = tuple(o for o in slow if o.name == "TRANSPOSE")
    if slow:
        first = slow[0].module_path or ""
        raise FloatOpsError(
            "The converted model would dequantize or transpose weights at every invocation: "
            + ", ".join(f"{o.name} (module {o.module_path or ''!r})" for o in slow) + ". A float op reads "
            "a weight the plan stores quantized, which runs slower than float. Give those ops an "
            f"activation qtype so an integer kernel reads the weight, or keep them in float, e.g. "
            f"Rule({first!r}, skip=True) before your other rules, with allow_float_ops=True."
        )
    if static and summary.float_islands:
        listing = _float_op_listing(summary.float_islands)
        if not allow_float_ops:
            raise FloatOpsError(
                f"The full-integer export has float islands: {listing}. Quantize those ops "
                "(a rule with act_qtype) or pass allow_float_ops=True to accept them."
            )
        warnings.warn(f"float ops in the exported model: {listing}; all of them are in "
                      "the export's summary.float_islands", stacklevel=3)


def _float_op_listing(ops, limit: int = 12) -> str:
    """Float ops grouped by module path, in model order: 'ADD (module 'a/b')' for a
    lone op, 'MUL x3, ADD (module 'a/gelu')' for several; the first `limit` modules."""
    groups: dict[str, dict[str, int]] = {}
    for o in ops:
        kinds = groups.setdefault(o.module_path or "", {})
        kinds[o.name] = kinds.get(o.name, 0) + 1
    items = [", ".join(name if n == 1 else f"{name} x{n}" for name, n in kinds.items()) + f" (module {path!r})"
             for path, kinds in groups.items()]
    more = len(items) - limit
    return "; ".join(items[:limit]) + (f"; and {more} more modules ({len(ops)} ops in all)" if more > 0 else "")


def _input_names(model: Any, n: int) -> list[str]:
    if is_keras(model):
        names = keras_input_names(model) or []
        return names if len(names) == n else [f"input_{i}" for i in range(n)]
    try:
        fn = model.__call__
        names = [p.name for p in pyinspect.signature(fn).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        names = []
    return names[:n] if len(names) >= n else [f"input_{i}" for i in range(n)]


def _write_atomically(path: str | os.PathLike, data: bytes) -> str:
    with atomic_output(path) as temporary:
        with open(temporary, "wb") as f:
            f.write(data)
    return os.fspath(path)
