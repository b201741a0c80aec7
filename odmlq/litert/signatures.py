"""export_signatures: several methods of one model in one .tflite, their weights stored once.

A language model on a phone is one file with a ``prefill`` and a ``decode``
entry point (LiteRT signatures) reading the same weights. Each signature is
a method of the model with its own representative data; all of them are
planned with the same rules. The first signature's data rounds the weights
(GPTQ, where a rule's algorithm reads data) and every signature uses those
same integers and scales, so the converter stores each weight once.

Each signature is exported as `export_tflite` exports one model, verified op
by op against `simulate` on its own held-back batch; the signatures are then
converted together into one flatbuffer, each in its own subgraph, and the
combined file is checked against the single ones: the same ops in each
subgraph, and the same outputs, bit for bit, on the verification rows.
With ``state_dtype='int8'`` the tensors a signature takes and gives back by
one name (the cache) then cross the file as int8 codes (`_state_io`).

Example:
  >>> cache = model.empty_cache(1)   # keys_0, values_0, keys_1, ... as tensors
  >>> result = odmlq.export_signatures(model, rules, {
  ...     'prefill': odmlq.Signature(method='prefill', rep_dataset=prompts),
  ...     'decode': odmlq.Signature(method='decode', rep_dataset=steps)},
  ...     'decoder.tflite', variables=variables)
  >>> runner = odmlq.litert.interpreter(result.tflite).get_signature_runner('decode')
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from ai_edge_litert import schema_py_generated as schema

from odmlq.batches import leaves, row_count
from odmlq.errors import OdmlqError, PlanError
from odmlq.files import check_output_path
from odmlq.litert import _convert, _external
from odmlq.litert._probe import LiteRTCrashError, probe
from odmlq.litert._runtime import interpreter
from odmlq.litert._prepare import Prepared, prepare
from odmlq.litert._state_io import check_integer_state, integer_state, state_of, unified
from odmlq.litert.export import Export, annotated, build, finished, with_module_paths, write_atomically
from odmlq.litert._samples import verification_samples
from odmlq.progress import Stage

__all__ = ["Signature", "SignatureExport", "export_signatures"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Signature:
    """One entry point of `export_signatures`.

    Attributes:
      rep_dataset: batches of this method's inputs (calibration; the last
        batch is held back to verify on, as in `export_tflite`).
      method: the Linen or NNX method (default: the model's call).
      example_inputs: the exported shapes (default: the first row of the first batch).
      input_names, output_names: the signature's tensor names (default: the
        method's parameter names; ``output_0``, ...).
    """

    rep_dataset: Iterable | Callable
    method: str | None = None
    example_inputs: Sequence[Any] | None = None
    input_names: Sequence[str] | None = None
    output_names: Sequence[str] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SignatureExport:
    """What `export_signatures` made.

    Attributes:
      tflite: the file's bytes (one subgraph and signature per entry point).
      path: where it was written, or None.
      signatures: name -> the `Export` of that signature alone (its plan,
        scales, summary, delegation and op-by-op verification).
    """

    tflite: bytes
    path: str | None
    signatures: dict[str, Export]

    def __str__(self) -> str:
        alone = sum(len(single.tflite) for single in self.signatures.values())
        lines = [f"{self.path or '<bytes>'}: {len(self.tflite):,} bytes ({alone:,} as separate files), "
                 f"signatures {', '.join(self.signatures)}"]
        for name, single in self.signatures.items():
            ops = sum(single.summary.op_histogram.values())
            check = "not verified" if single.verification is None else str(single.verification).split("\n", 1)[0]
            lines.append(f"  {name}: {ops} ops; {single.delegation}; {check}")
        return "\n".join(lines)


def export_signatures(model: Any, rules: Sequence, signatures: Mapping[str, Signature],
                      path: str | os.PathLike | None = None, *, variables: Any = None, verify: bool = True,
                      verify_samples: int = 32, allow_float_ops: bool = False,
                      external_weights: bool | None = None, state_dtype: str = "float",
                      progress: bool | None = None) -> SignatureExport:
    """Exports several methods of `model` into one LiteRT flatbuffer (see the module doc).

    Args:
      model: a Linen module (pass `variables`) or an NNX module.
      rules: the rules, for every signature.
      signatures: signature name (a Python identifier) -> `Signature`, in the
        file's order.
      path: where to write the file (atomically), or None.
      verify, verify_samples, allow_float_ops, external_weights, progress:
        as `export_tflite`'s (a weight several signatures read is stored once).
      state_dtype: 'float' (default: every input and output float), or
        'int8': the tensors a signature takes and gives back under one name
        (a KV cache) cross the file as int8 codes, each name on one scale in
        every signature (`odmlq.litert._state_io`; full-integer rules).

    Raises:
      PlanError: no signature, a name that is not an identifier, signatures
        whose rules give different schemas (full-integer and dynamic-range
        cannot share one conversion); and what `export_tflite` raises, for
        the signature it names.
      ConversionError: the combined file differs from the signatures converted alone.
    """
    if path is not None:
        check_output_path(path)
    _check_names(signatures)
    if state_dtype not in ("float", "int8"):
        raise PlanError(f"state_dtype={state_dtype!r}; choose 'float' or 'int8'.")
    states = ({name: state_of(name, s.input_names, s.output_names) for name, s in signatures.items()}
              if state_dtype == "int8" else {})
    prepared: dict[str, Prepared] = {}
    for name, signature in signatures.items():
        first = next(iter(prepared.values()), None)
        prepared[name] = _named(name, lambda: prepare(
            model, rules, signature.rep_dataset, variables=variables, example_inputs=signature.example_inputs,
            allow_float_ops=allow_float_ops, input_names=signature.input_names,
            output_names=signature.output_names, method=signature.method, progress=progress,
            weights=None if first is None else first.scales, state=states.get(name)))
    schemas = {name: p.schema for name, p in prepared.items()}
    if len(set(schemas.values())) > 1:
        raise PlanError(f"The signatures' rules give different schemas ({schemas}); one file is converted "
                        "as one schema. Give every signature the same kind of activation quantization.")
    if states:
        prepared = _on_shared_state_scales(model, prepared, states, signatures, variables, allow_float_ops, progress)
    singles = {name: _named(name, lambda: build(model, p, variables=variables, verify=verify,
                                                 verify_samples=verify_samples, allow_float_ops=allow_float_ops,
                                                 progress=progress, external_weights=external_weights))
               for name, p in prepared.items()}
    tflite, externalized = _combined(model, prepared, variables, progress, external_weights)
    try:
        probe(tflite, f"the model exported for {os.fspath(path)!r}" if path is not None else "the exported model")
    except LiteRTCrashError as error:
        raise LiteRTCrashError(f"{error}\nNothing was written.") from None
    _check_combined(tflite, singles, prepared, verify_samples)
    if states:
        if externalized:
            raise PlanError("state_dtype='int8' rewrites the converted file, whose weights are written outside "
                            "the flatbuffer here (external_weights); pass external_weights=False or "
                            "state_dtype='float'. Nothing was written.")
        tflite = integer_state(tflite, {name: [prepared[name].input_names[i] for i in state]
                                        for name, state in states.items()})
        check_integer_state(tflite, singles, prepared, interpreter,
                            lambda held: verification_samples(held, verify_samples))
    written = write_atomically(path, tflite) if path is not None else None
    return SignatureExport(tflite=tflite, path=written, signatures=singles)


def _check_names(signatures: Mapping[str, Signature]) -> None:
    if not signatures:
        raise PlanError("export_signatures needs at least one signature, e.g. "
                        "{'decode': odmlq.Signature(method='decode', rep_dataset=batches)}.")
    for name, signature in signatures.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise PlanError(f"Signature name {name!r} is not an identifier; use names such as 'prefill', 'decode'.")
        if not isinstance(signature, Signature):
            raise PlanError(f"Signature {name!r} is a {type(signature).__name__}; give an odmlq.Signature("
                            "method=..., rep_dataset=...).")


def _named(name: str, step: Callable[[], Any]) -> Any:
    """`step()`, its odmlq errors prefixed with the signature they concern."""
    try:
        return step()
    except OdmlqError as error:
        message = f"Signature {name!r}: {error}"
        try:
            raised = type(error)(message)
        except TypeError:  # an error class with more required arguments
            raise error from None
        raised.__dict__.update(error.__dict__)
        raise raised from error


def _combined(model: Any, prepared: Mapping[str, Prepared], variables: Any, progress,
              external_weights: bool | None) -> bytes:
    """All signatures converted into one flatbuffer, each in its subgraph."""
    texts, payloads, placeholders = [], {}, {}
    for name, p in prepared.items():
        fn, blockwise, held_back = annotated(model, p, variables=variables, external_weights=external_weights)
        texts.append((name, _convert.lowered(fn, p.example_inputs), p.input_names, p.output_names))
        payloads[name] = blockwise
        placeholders.update({h.param: h for h in held_back})  # the signatures share their weights
    dynamic = next(iter(prepared.values())).schema == "dynamic"
    try:
        with Stage("converting the signatures together", progress=progress):
            tflite = _convert.convert_signatures(texts, dynamic_range=dynamic)
    except _convert.ConversionError as error:
        raise with_module_paths(error, next(iter(prepared.values())).plan) from error
    subgraphs = _subgraphs(tflite)
    for name, p in prepared.items():
        tflite = finished(tflite, p, payloads[name], subgraph=subgraphs[name])
    if placeholders:
        with Stage("writing the weights", progress=progress):
            held, tflite = [tflite], None
            tflite = _external.externalized(held, list(placeholders.values()))
    return tflite, bool(placeholders)


def _on_shared_state_scales(model, prepared, states, signatures, variables, allow_float_ops, progress) -> dict:
    """The signatures prepared again with each state name on one range
    (`_state_io.unified`): the calibration and the first signature's weights
    kept, the scales computed from the shared ranges."""
    if next(iter(prepared.values())).schema != "static":
        raise PlanError("state_dtype='int8' needs full-integer rules (act_qtype='int8' without act_dynamic): "
                        "a dynamic-range model keeps its cache float.")
    plans, weights = unified(prepared, states), next(iter(prepared.values())).scales
    return {name: _named(name, lambda: prepare(
        model, plans[name][0], signatures[name].rep_dataset, variables=variables,
        example_inputs=signatures[name].example_inputs, calibration=plans[name][1],
        allow_float_ops=allow_float_ops, input_names=p.input_names, output_names=p.output_names,
        progress=progress, weights=weights)) for name, p in prepared.items()}


def _subgraphs(tflite: bytes) -> dict[str, int]:
    """Signature name -> its subgraph's index."""
    model = schema.ModelT.InitFromPackedBuf(bytearray(tflite), 0)
    return {s.signatureKey.decode(): int(s.subgraphIndex) for s in model.signatureDefs or []}


def _histograms(tflite: bytes) -> dict[int, dict[str, int]]:
    """Subgraph index -> {op name: count}."""
    model = schema.ModelT.InitFromPackedBuf(bytearray(tflite), 0)
    names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    out = {}
    for index, graph in enumerate(model.subgraphs or []):
        counts: dict[str, int] = {}
        for op in graph.operators or []:
            code = model.operatorCodes[op.opcodeIndex]
            name = names.get(max(code.builtinCode, code.deprecatedBuiltinCode), "CUSTOM")
            counts[name] = counts.get(name, 0) + 1
        out[index] = counts
    return out


def _check_combined(tflite: bytes, singles: Mapping[str, Export], prepared: Mapping[str, Prepared],
                    verify_samples: int) -> None:
    """Each signature of the combined file computes what its own verified file computes."""
    subgraphs, combined = _subgraphs(tflite), _histograms(tflite)
    runner = interpreter(tflite)
    for name, single in singles.items():
        own = _histograms(single.tflite)[0]
        if combined[subgraphs[name]] != own:
            raise _convert.ConversionError(
                f"Signature {name!r} converted with the others has other ops ({combined[subgraphs[name]]}) "
                f"than converted alone ({own}), which is what was verified; nothing was written.")
        p = prepared[name]
        alone = interpreter(single.tflite).get_signature_runner()
        together = runner.get_signature_runner(name)
        batch = row_count(p.example_inputs)
        for rows in verification_samples(p.held_back, verify_samples):
            for start in range(0, row_count(rows) - batch + 1, batch):
                feed = {key: np.asarray(x)[start:start + batch] for key, x in zip(p.input_names, leaves(rows))}
                _same_outputs(name, alone(**feed), together(**feed))


def _same_outputs(name: str, expected: dict, got: dict) -> None:
    for key in expected:
        if not np.array_equal(expected[key], got[key]):
            raise _convert.ConversionError(
                f"Signature {name!r}: output {key!r} of the combined file differs from the file verified "
                f"alone (max difference {np.max(np.abs(expected[key] - got[key])):.3g}); nothing was written.")

