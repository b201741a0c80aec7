"""export_tflite: a Flax model to a verified full-integer LiteRT flatbuffer."""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from odmlq.batches import leaves, row_count
from odmlq.calibration import Calibration
from odmlq.errors import OdmlqError
from odmlq.files import atomic_output, check_output_path
from odmlq.graph import flat_params, params_for
from odmlq.litert import _annotate, _blockwise, _convert, _external, _repair
from odmlq.litert._check import FloatOpsError, check_plan
from odmlq.litert._prepare import Prepared, prepare
from odmlq.litert._probe import LiteRTCrashError, probe
from odmlq.litert.inspect import ModelSummary, inspect
from odmlq.litert.speed import (AUTO_BENCHMARK_BYTES, Delegation, Latency, benchmark_threads, check_delegation,
                                delegation as delegation_of, slower_than_float, timed_against_float)
from odmlq.progress import Stage
from odmlq.litert._samples import held_back_count, verification_samples
from odmlq.litert.verify import VerificationReport, verify as verify_model
from odmlq.plan import Plan
from odmlq.scales import Scales

__all__ = ["export_tflite", "Export", "FloatOpsError", "check_plan"]


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
    # Which ops XNNPACK runs (partitions, ops on reference kernels), and when
    # benchmarked the measured latency against the float twin on each thread
    # count timed (one thread first; `latency`: that one).
    delegation: Delegation | None = None
    latencies: tuple[Latency, ...] = ()

    @property
    def latency(self) -> Latency | None:
        """The one-thread latency against the float twin, when benchmarked."""
        return self.latencies[0] if self.latencies else None

    def __str__(self) -> str:
        lines = [f"{self.path or '<bytes>'}: {len(self.tflite)} bytes, batch size {self.batch_size}, ops: "
                 + ", ".join(f"{k} x{v}" for k, v in self.summary.op_histogram.items()),
                 "float islands: " + (", ".join(f"{o.name} ({o.module_path})" for o in
                                                self.summary.float_islands) or "none")]
        if self.scales.int8_outputs:
            lines.append("outputs kept int8 (their input's second rounding would cost more than an int8 output: "
                         "Scales.int8_outputs): " + ", ".join(
                             f"{op} ({ratio:.1f}x)" for op, ratio in self.scales.int8_outputs.items()))
        if self.summary.dynamic_kernels:
            lines.append("dynamic-range kernels (input quantized at run time, output float): " + ", ".join(
                f"{o.name} ({o.module_path})" for o in self.summary.dynamic_kernels))
        lines += [str(x) for x in (self.delegation, *self.latencies) if x is not None]
        if self.verification is not None:
            lines.append(str(self.verification))
        return "\n".join(lines)


def export_tflite(model: Any, rules: Sequence | Plan, rep_dataset: Iterable | Callable | None,
                  path: str | os.PathLike | None = None, *, variables: Any = None,
                  example_inputs: Sequence[Any] | None = None,
                  calibration: Calibration | None = None, verify: bool = True,
                  verify_samples: int = 32, allow_float_ops: bool = False,
                  input_names: Sequence[str] | None = None,
                  output_names: Sequence[str] | None = None,
                  io_dtype: str = "float",
                  batch_size: int = 1,
                  require_delegate: bool = False,
                  benchmark: bool | None = None,
                  method: str | Callable | None = None,
                  external_weights: bool | None = None,
                  progress: bool | None = None) -> Export:
    """Exports `model` as a LiteRT flatbuffer quantized by `rules`, and checks it.

    Args:
      model: a Linen module (pass `variables`) or an NNX module.
      rules: rules (or a ready Plan).
      rep_dataset: representative batches (iterable, or callable returning
        one). The last batch is held back from calibration and used to verify
        when there are two or more. A batch is an array, or a tuple of
        inputs; an input may be a dict or list of arrays (a tokenizer's
        batch): the .tflite takes its arrays in `jax.tree` order, named
        after their keys (``input_ids``; ``<argument>_<key>`` where the model
        takes several inputs), and writes its outputs' arrays, in the same
        order, as ``output_<i>``.
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
      require_delegate: refuse the export (`DelegateError`, naming the ops)
        when any op runs outside LiteRT's default delegate, XNNPACK. Without
        it the export warns when a quantized matmul or convolution runs
        outside XNNPACK (the model may be slower than float); either way
        `Export.delegation` lists the partitions and the ops outside.
      benchmark: also convert the float twin (the same model, no rules) and
        time both at the exported batch size in interleaved rounds, on one
        thread and on two where the machine has two cores (`Export.latency`,
        `Export.latencies`; 11 rounds each); warn when the export is slower
        by the medians, or in a third of the rounds or more (not reliably
        faster). None (default): when the model's float weights are at most
        `speed.AUTO_BENCHMARK_BYTES` (32 MiB: the twin converts in under a
        second), where a quantized model can be slower than float with every
        op on XNNPACK; a twin that fails to convert then only warns. False:
        never.
      external_weights: store the quantized weights after the flatbuffer
        (``Buffer.offset``/``size``: the file may pass flatbuffers' 2 GB) and
        hand them to the converter as placeholders, writing each one's
        integers into the file afterwards, so no weight is held as StableHLO
        text or by the converter. None (default): when the quantized weights
        pass 1 GiB in float32. The file loads like any other .tflite.
      progress: bars on stderr while calibrating, converting and verifying
        (default: when stderr is a terminal; False: never).
      method: the Linen or NNX method to export (default: the model's call),
        as `odmlq.plan` takes it; a Plan given as `rules` carries its own.
      io_dtype: 'float' (the model quantizes its inputs and dequantizes its
        outputs) or 'int8' / 'int16' (the caller passes quantized tensors; the
        input and output scales are in the signature's tensors). Full-integer
        schemas only.

    The schema follows from the rules (see `_prepare.schema_of`): calibrated int8 or
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
      DelegateError: `require_delegate` and an op outside XNNPACK.

    Example:
      >>> result = odmlq.export_tflite(model, [odmlq.Rule('.*', weight_qtype='int8',
      ...     act_qtype='int8')], batches, 'model.tflite', variables=variables)
      >>> print(result)
    """
    if path is not None:
        check_output_path(path)  # before any work
    prepared = prepare(model, rules, rep_dataset, variables=variables, example_inputs=example_inputs,
                       calibration=calibration, allow_float_ops=allow_float_ops, input_names=input_names,
                       output_names=output_names, io_dtype=io_dtype, batch_size=batch_size, method=method,
                       progress=progress)
    return build(model, prepared, path, variables=variables, verify=verify, verify_samples=verify_samples,
                 allow_float_ops=allow_float_ops, require_delegate=require_delegate, benchmark=benchmark,
                 progress=progress, external_weights=external_weights)


def annotated(model: Any, prepared: Prepared, *, variables: Any = None,
              external_weights: bool | None = None) -> _annotate.Annotated:
    """The prepared model as the function litert-converter converts, and what
    its file needs put in afterwards (`_annotate.Annotated`).

    `external_weights`: see `export_tflite`; None decides by the quantized
    weights' size (`uses_external_weights`)."""
    params = params_for(model, variables, "export_tflite")
    if external_weights is None:
        external_weights = uses_external_weights(prepared.scales, params)
    return _annotate.annotated_function(prepared.graph, prepared.plan, prepared.scales, params, prepared.float_ops,
                                        external_weights=external_weights, rsqrt_pieces=prepared.rsqrt_pieces)


def uses_external_weights(scales: Scales, params: Any) -> bool:
    """Whether the quantized weights hold more float32 bytes than
    `_external.EXTERNAL_AUTO_BYTES`: their text alone would pass 2 GB."""
    flat = flat_params(params)
    return _float32_bytes(flat[p] for p in scales.weights if p in flat) > _external.EXTERNAL_AUTO_BYTES


def finished(tflite: bytes, prepared: Prepared, blockwise, subgraph: int = 0) -> bytes:
    """The converter's flatbuffer with what it cannot write put in: int4 block
    payloads (into `subgraph`, the prepared signature's), int64 biases of 16x8
    convolutions, an integer interface. (Placeholders are written last, for
    every signature at once: `_external.externalized`.)"""
    tflite = _blockwise.write_blockwise(tflite, blockwise, subgraph)
    # litert-converter 0.5.0 writes an int32 bias for 16x8 convolutions, whose
    # kernels read int64 (outputs off by the whole range, or a depthwise
    # convolution refused at allocation): the bias is rewritten in the file.
    tflite = _repair.repair_int16_conv_bias(tflite, int32_bias_when_exact=True)
    # It also leaves int16 ADD/SUB on LiteRT's power-of-two path, taken when
    # the scales are powers of two by chance (refused, or computed otherwise).
    tflite = _repair.repair_int16_add_sub(tflite)
    if prepared.io_dtype != "float":
        tflite = _integer_interface(tflite, prepared.io_dtype)
    return tflite


def build(model: Any, prepared: Prepared, path: str | os.PathLike | None = None, *, variables: Any = None,
          verify: bool = True, verify_samples: int = 32, allow_float_ops: bool = False,
          require_delegate: bool = False, benchmark: bool | None = False, progress: bool | None = None,
          external_weights: bool | None = None) -> Export:
    """Converts, checks, verifies and writes a prepared export (see `export_tflite`)."""
    plan, schema = prepared.plan, prepared.schema
    fn, blockwise, placeholders = annotated(model, prepared, variables=variables, external_weights=external_weights)
    try:
        with Stage("converting", progress=progress):
            tflite = _convert.convert(fn, prepared.example_inputs, input_names=prepared.input_names,
                                      output_names=prepared.output_names, dynamic_range=schema == "dynamic")
    except _convert.ConversionError as error:
        raise with_module_paths(error, plan) from error
    del fn  # (its closure holds the weights' values on the grid)
    tflite = finished(tflite, prepared, blockwise)
    if placeholders:
        with Stage("writing the weights", progress=progress):
            held, tflite = [tflite], None
            tflite = _external.externalized(held, placeholders)
    summary = inspect(tflite)
    _check_summary(schema, summary, allow_float_ops, prepared.float_ops)
    # Never write (or load here) a file that crashes LiteRT: a child process tries it first.
    try:
        probe(tflite, f"the model exported for {os.fspath(path)!r}" if path is not None else "the exported model")
    except LiteRTCrashError as error:
        raise LiteRTCrashError(f"{error}\nNothing was written.") from None
    delegation = delegation_of(tflite, summary)
    strict = benchmark is not None
    if benchmark is None:
        benchmark = schema != "float" and _float_bytes(model, variables) <= AUTO_BENCHMARK_BYTES
    check_delegation(delegation, schema, require_delegate, timed=bool(benchmark))
    latencies = ()
    if benchmark:
        latencies = _benchmark(model, tflite, prepared.example_inputs, variables=variables, progress=progress,
                               names=(prepared.input_names, prepared.output_names), io_dtype=prepared.io_dtype,
                               method=plan.graph.method, strict=strict)
    report = None
    if verify:
        samples = verification_samples(prepared.held_back, verify_samples)
        report = verify_model(tflite, model, plan, prepared.scales, samples, variables=variables,
                              min_output_sqnr_db=_MIN_SQNR_DB.get(schema), progress=progress,
                              float_samples=held_back_count(prepared.held_back, verify_samples))
    written = write_atomically(path, tflite) if path is not None else None
    return Export(tflite=tflite, path=written, plan=plan, calibration=prepared.calibration, scales=prepared.scales,
                  summary=summary, verification=report, delegation=delegation, latencies=latencies,
                  batch_size=row_count(prepared.example_inputs))


def _benchmark(model, tflite: bytes, example_inputs, *, variables, progress, names, io_dtype: str, method,
               strict: bool) -> tuple[Latency, ...]:
    """The export's latency against its float twin's on each of `benchmark_threads()`
    (`speed.timed_against_float`); warns when the export is, or may be, the slower one.
    Not `strict` (the default benchmark): a twin that does not convert warns
    and nothing is timed."""
    with Stage("benchmarking", progress=progress):
        try:
            twin = export_tflite(model, [], None, variables=variables, example_inputs=example_inputs, verify=False,
                                 input_names=names[0], output_names=names[1], method=method, benchmark=False,
                                 progress=False).tflite
        except OdmlqError as error:
            if strict:
                raise
            warnings.warn(f"Not timed against float (benchmark=None): the float twin (the same model, no "
                          f"rules) did not convert: {str(error).splitlines()[0]} Export with benchmark=False "
                          "to skip the timing, or export it with rules=[] to see the whole error.", stacklevel=4)
            return ()
        # Float inputs where the export reads float; an integer interface reads zeros.
        inputs = [np.asarray(x) for x in leaves(example_inputs)] if io_dtype == "float" else []
        latencies = [timed_against_float(tflite, twin, inputs, num_threads=threads) for threads in benchmark_threads()]
    message = slower_than_float(latencies)
    if message is not None:
        warnings.warn(message, stacklevel=4)
    return tuple(latencies)


def _float_bytes(model: Any, variables: Any) -> int:
    """Bytes of the model's parameters in float32."""
    return _float32_bytes(flat_params(params_for(model, variables, "export_tflite")).values())


def _float32_bytes(arrays: Iterable) -> int:
    """Bytes of `arrays` in float32."""
    return sum(4 * int(np.prod(np.shape(x), dtype=np.int64)) for x in arrays)


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


def with_module_paths(error, plan: Plan):
    """The converter's error, with the plan ops (and module paths) it names."""
    ops = []
    for location in error.locations:
        matches = [op for op in plan.graph.ops if location == op.id or location.startswith(op.id + "/")]
        if matches:
            op = max(matches, key=lambda o: len(o.id))
            ops.append(f"op {op.id!r} (module {op.module_path!r}, kind {op.kind!r})")
    where = "; ".join(dict.fromkeys(ops)) or "no op of the plan is named in the diagnostics"
    return _convert.ConversionError(f"{error}\nFailing: {where}.")


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
    composites = [o for o in summary.ops if o.name == "STABLEHLO_COMPOSITE"]
    if composites:
        first = composites[0].module_path or ""
        raise _convert.ConversionError(
            f"litert-converter left {len(composites)} quantization markers it did not lower "
            f"(STABLEHLO_COMPOSITE ops) in the model: {_float_op_listing(composites)}. They would run "
            "their float decomposition outside XNNPACK, not the quantization the plan says. Keep those "
            f"ops in float, e.g. Rule({first!r}, skip=True) before your other rules; nothing was written.")
    slow = summary.weight_work_at_run_time
    if schema == "weight_only":  # dequantizing the weights is what weight-only means
        slow = tuple(o for o in slow if o.name != "DEQUANTIZE")
    if slow:
        first = slow[0].module_path or ""
        if all(o.name == "QUANTIZE" for o in slow):
            raise FloatOpsError(
                "The converted model would requantize weights at every invocation: "
                + ", ".join(f"QUANTIZE (module {o.module_path or ''!r})" for o in slow) + ". The op reading "
                "each weight takes another scale than the weight's own (a gathered table keeps its "
                "table's), which litert-converter meets by requantizing the whole weight at run time. Quantize "
                f"that weight per tensor, or keep the op in float, e.g. Rule({first!r}, skip=True) before "
                "your other rules, with allow_float_ops=True.")
        raise FloatOpsError(
            "The converted model would dequantize or transpose weights at every invocation: "
            + ", ".join(f"{o.name} (module {o.module_path or ''!r})" for o in slow) + ". A float op reads "
            "a weight the plan stores quantized, which runs slower than float. Give those ops an "
            f"activation qtype so an integer kernel reads the weight, or keep them in float, e.g. "
            f"Rule({_module_of(first)!r}, skip=True) before your other rules, with allow_float_ops=True."
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


def _module_of(scope: str) -> str:
    """The module path a rule matches, from the scope a weight's DEQUANTIZE
    ('dense/kernel') or an op ('dense/dot_general') is named in: its last name
    dropped, and the scope of an unrolled loop's step ('.../scan/step_0/')."""
    scope = re.sub(r"^.*/step_\d+/", "", scope)
    return scope.rsplit("/", 1)[0] if "/" in scope else scope


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


def write_atomically(path: str | os.PathLike, data: bytes) -> str:
    with atomic_output(path) as temporary:
        with open(temporary, "wb") as f:
            f.write(data)
    return os.fspath(path)
