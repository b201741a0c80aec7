"""State that crosses a .tflite's signatures as int8 (internal; `export_signatures` calls it).

A decoder's ``prefill`` and ``decode`` signatures take the KV cache in and
give it back under the same names (``keys_0`` in, ``keys_0`` out). With
``state_dtype='int8'`` those tensors cross the file as their int8 codes,
which the app keeps between calls (a quarter of float's memory, and no
QUANTIZE / DEQUANTIZE over the whole cache at every step):

- each signature is planned with its state pairs (`odmlq.plan`'s ``state``):
  one scale for a pair;
- every signature's pair of one name gets one range, the union of what each
  signature calibrated (`unified`): a cache written by prefill is read by
  decode on the same grid;
- in the converted file, the QUANTIZE after each state input and the
  DEQUANTIZE before each state output are removed, the integer tensors
  becoming the signature's (`integer_state`);
- the result is checked against the float-interface signatures verified op
  by op (`check_integer_state`): the same integers in, the same outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import flatbuffers
import numpy as np
from ai_edge_litert import schema_py_generated as schema

from odmlq.batches import leaves, row_count
from odmlq.calibration import Calibration, FixedRange
from odmlq.errors import PlanError
from odmlq.litert._convert import ConversionError
from odmlq.litert._repair import FILE_IDENTIFIER, aligned_buffers

__all__ = ["check_integer_state", "integer_state", "state_of", "unified"]


def state_of(name: str, input_names: Sequence[str] | None, output_names: Sequence[str] | None) -> dict[int, int]:
    """``{input index: output index}`` of the tensors a signature takes and gives back by one name.

    Raises:
      PlanError: the signature names none (state_dtype='int8' needs them).
    """
    inputs, outputs = list(input_names or ()), list(output_names or ())
    state = {inputs.index(n): outputs.index(n) for n in inputs if n in outputs}
    if not state:
        raise PlanError(f"Signature {name!r}: state_dtype='int8' crosses the tensors a signature takes and "
                        "gives back under one name (a KV cache), but its input_names and output_names share "
                        "none; name them alike (input_names=['token', 'position', 'keys_0', ...], "
                        "output_names=['logits', 'keys_0', ...]).")
    return state


def unified(prepared: Mapping, states: Mapping[str, dict[int, int]]) -> dict:
    """``{signature: (plan, calibration)}`` with every state pair of one name on
    one range: the union of the ranges the signatures calibrated for it, as a
    `FixedRange` on the pair's output edge (its input takes the output's scale).

    Raises:
      PlanError: a state edge that is not int8 with one scale per tensor.
    """
    ranges: dict[str, tuple[float, float]] = {}
    edges_of: dict[str, dict[str, str]] = {}
    for name, p in prepared.items():
        graph, edges_of[name] = p.plan.graph, {}
        for i, o in states[name].items():
            tensor = p.input_names[i]
            result = graph.resolve(graph.outputs[o])
            ts = p.scales.edges.get(result)
            if ts is None or ts.qtype.name != "int8" or ts.scale_axes or ts.block_size is not None:
                have = "float" if ts is None else p.plan.edges[result].spec.describe()
                raise PlanError(f"Signature {name!r}: state tensor {tensor!r} is {have}, but state_dtype='int8' "
                                "crosses it as int8 with one scale; give the op writing it act_qtype='int8' per "
                                "tensor (the one-line full-integer rule does), or state_dtype='float'.")
            scale = float(np.ravel(ts.scale)[0])
            zero = 0.0 if ts.zero_point is None else float(np.ravel(ts.zero_point)[0])
            lo, hi = (ts.qtype.qmin - zero) * scale, (ts.qtype.qmax - zero) * scale
            old = ranges.get(tensor, (lo, hi))
            ranges[tensor] = (min(old[0], lo), max(old[1], hi))
            edges_of[name][tensor] = result
    out = {}
    for name, p in prepared.items():
        edges, fixed = dict(p.plan.edges), {}
        for tensor, result in edges_of[name].items():
            fixed[result] = FixedRange(*ranges[tensor])
            edges[result] = dataclasses.replace(edges[result], spec=dataclasses.replace(
                edges[result].spec, calibration=fixed[result]),
                reason=edges[result].reason + "; one range in every signature")
        calibration = Calibration({e: (fixed[e], p.calibration[e][1]) if e in fixed else p.calibration[e]
                                   for e in p.calibration}, grams=p.calibration.grams)
        out[name] = (dataclasses.replace(p.plan, edges=edges), calibration)
    return out


def integer_state(tflite: bytes, names: Mapping[str, Sequence[str]]) -> bytes:
    """`tflite` with each signature's named state tensors crossing as their integer
    codes: the QUANTIZE reading the float input and the DEQUANTIZE writing the
    float output removed, their integer tensors the signature's.

    Raises:
      ConversionError: a named tensor not read by one QUANTIZE alone, or not
        written by a DEQUANTIZE.
    """
    model = schema.ModelT.InitFromPackedBuf(bytearray(tflite), 0)
    codes = {i: max(c.builtinCode, c.deprecatedBuiltinCode) for i, c in enumerate(model.operatorCodes)}
    for signature in model.signatureDefs or []:
        key = signature.signatureKey.decode()
        graph, wanted = model.subgraphs[signature.subgraphIndex], set(names.get(key, ()))
        removed = set()
        for side, kind in ((signature.inputs, schema.BuiltinOperator.QUANTIZE),
                           (signature.outputs, schema.BuiltinOperator.DEQUANTIZE)):
            for entry in side or []:
                if entry.name.decode() not in wanted:
                    continue
                t = entry.tensorIndex
                if kind == schema.BuiltinOperator.QUANTIZE:
                    ops = [k for k, op in enumerate(graph.operators) if t in list(op.inputs)]
                    op = graph.operators[ops[0]] if len(ops) == 1 else None
                    replacement = None if op is None else int(op.outputs[0])
                    lists = (graph.inputs,)
                else:
                    ops = [k for k, op in enumerate(graph.operators) if t in list(op.outputs)]
                    op = graph.operators[ops[0]] if len(ops) == 1 else None
                    replacement = None if op is None else int(op.inputs[0])
                    lists = (graph.outputs,)
                if op is None or codes[op.opcodeIndex] != kind:
                    raise ConversionError(
                        f"Signature {key!r}: state tensor {entry.name.decode()!r} is not "
                        f"{'read by one QUANTIZE' if kind == schema.BuiltinOperator.QUANTIZE else 'written by a DEQUANTIZE'}"
                        " in the converted file, so it cannot cross as int8; use state_dtype='float'.")
                removed.add(ops[0])
                entry.tensorIndex = replacement
                for indices in lists:
                    indices[list(indices).index(t)] = replacement
        graph.operators = [op for k, op in enumerate(graph.operators) if k not in removed]
    model.buffers = aligned_buffers(model.buffers)
    builder = flatbuffers.Builder(len(tflite) + 1024)
    builder.Finish(model.Pack(builder), file_identifier=FILE_IDENTIFIER)
    return bytes(builder.Output())


def check_integer_state(tflite: bytes, singles: Mapping, prepared: Mapping, interpreter, samples) -> None:
    """Each signature of `tflite` (int8 state) against its float-interface file
    verified alone: state inputs on their grid, fed as codes there and as
    floats here, give the same outputs (state outputs: their codes).

    Raises:
      ConversionError: an output that differs.
    """
    runner = interpreter(tflite)
    grids: dict[str, tuple] = {}
    for name in singles:
        signature = runner.get_signature_runner(name)
        for details in (signature.get_input_details(), signature.get_output_details()):
            for key, d in details.items():
                if d["dtype"] == np.int8:
                    if grids.setdefault(key, d["quantization"]) != d["quantization"]:
                        raise ConversionError(f"State tensor {key!r} crosses the signatures on two grids "
                                              f"({grids[key]} and {d['quantization']}); nothing was written.")
    for name, single in singles.items():
        p = prepared[name]
        together = runner.get_signature_runner(name)
        alone = interpreter(single.tflite).get_signature_runner()
        details = together.get_input_details()
        batch = row_count(p.example_inputs)
        for rows in samples(p.held_back):
            for start in range(0, row_count(rows) - batch + 1, batch):
                floats, feed = {}, {}
                for key, x in zip(p.input_names, leaves(rows)):
                    x = np.asarray(x)[start:start + batch]
                    d = details[key]
                    if d["dtype"] == np.int8 and x.dtype.kind == "f":
                        scale, zero = d["quantization"]
                        codes = _int8_codes(x, d["quantization"])
                        feed[key], floats[key] = codes, ((codes.astype(np.float32) - zero) * scale).astype(x.dtype)
                    else:
                        feed[key] = floats[key] = x
                expected, got = alone(**floats), together(**feed)
                outputs = together.get_output_details()
                for key, want in expected.items():
                    have = got[key]
                    if outputs[key]["dtype"] == np.int8 and want.dtype.kind == "f":
                        want = _int8_codes(want, outputs[key]["quantization"])
                    if not np.array_equal(want, have):
                        raise ConversionError(
                            f"Signature {name!r}: output {key!r} with the state as int8 differs from the "
                            "float-interface file verified op by op; nothing was written.")


def _int8_codes(x: np.ndarray, quantization: tuple) -> np.ndarray:
    """`x` as the int8 codes of a tensor quantized ``(scale, zero point)``."""
    scale, zero = quantization
    return np.clip(np.round(x / scale) + zero, -128, 127).astype(np.int8)
