"""Tensors dumped on a device, compared with the host interpreter's.

A device dump is an ``.npz`` with one array per tensor, keyed by the tensor's
name in the .tflite (or ``t<index>``), holding the raw stored values (int8,
int16 or float32) of one invocation on the inputs in ``--inputs``. The
script `samples/dump_tensors.py` writes one with the LiteRT Python
interpreter; on a phone without Python, dump the same tensors with your app
or benchmark tooling under the same keys.

`diff_device(tflite, inputs, dump)` runs the model on the host with every
tensor kept and compares tensor by tensor, in execution order: quantized
tensors in steps of their scale (LSB), all in SQNR. The first tensor where
the device parts from the host (more than 1 LSB) is named: what comes after
it inherits the difference.

A .tflite that odmlq did not make (no quantized tensor named after a traced
op, see `produced_by_odmlq`) is compared at its outputs only, and says so:
its intermediate tensors carry no plan edge to line them up with.

`odmlq.report.device_report` turns the same comparison into a report.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

import numpy as np

from odmlq.plan import text_table as table
from odmlq.errors import OdmlqError
from odmlq.litert.verify import from_output, preserving_interpreter, produced_tensors

__all__ = ["DeviceDiff", "NOT_ODMLQ", "TensorDiff", "check_model_inputs", "diff_device", "dump_tensors", "output_value",
           "produced_by_odmlq"]

NOT_ODMLQ = "not produced by odmlq: comparing outputs only"

_PART_LSB = 1.0  # integer kernels may round differently by one step


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorDiff:
    """One tensor, device against host: SQNR, max difference in LSB (quantized
    tensors), non-finite values on the device."""

    index: int
    name: str
    dtype: str
    sqnr_db: float
    max_lsb: float | None
    is_output: bool
    nan: int = 0  # non-finite values on the device (left out of the SQNR)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceDiff:
    """Every compared tensor in execution order, what the dump lacks, and the
    first tensor where the device parts from the host (None: they agree)."""

    tensors: tuple[TensorDiff, ...]
    missing: tuple[str, ...]
    parted_at: TensorDiff | None
    outputs_only: bool = False

    @property
    def output_sqnr_db(self) -> float:
        """The lowest SQNR of the outputs; -inf when the device output has NaN
        (a gate on it must fail)."""
        outs = [-math.inf if t.nan else t.sqnr_db for t in self.tensors if t.is_output]
        return min(outs) if outs else math.inf

    def __str__(self) -> str:
        rows = [[str(t.index), t.name[:60], t.dtype, _db(t.sqnr_db),
                 "-" if t.max_lsb is None else f"{t.max_lsb:.1f}", str(t.nan) if t.nan else "-",
                 "out" if t.is_output else ""]
                for t in self.tensors]
        lines = [NOT_ODMLQ] if self.outputs_only else []
        lines += ["Device vs host interpreter, in execution order",
                 table(["#", "tensor", "dtype", "SQNR dB", "max LSB", "NaN", ""], rows)]
        return "\n".join(lines + self.summary())

    def summary(self) -> list[str]:
        """Where the device parts from the host, the outputs' SQNR, what the dump lacks."""
        every = "output" if self.outputs_only else "tensor"
        lines = [f"device parts from host at: {self.parted_at.name} (tensor {self.parted_at.index})"
                 if self.parted_at else f"device and host agree within 1 LSB on every {every}",
                 f"outputs: {_db(self.output_sqnr_db)} dB"]
        if self.missing:
            lines.append(f"missing from the dump ({len(self.missing)}): " + ", ".join(self.missing))
        return lines


def _db(v: float) -> str:
    return ("inf" if v > 0 else "-inf") if math.isinf(v) else f"{v:.1f}"


# odmlq names each tensor after the traced op it computes: `jit(fn)/conv1/relu/...`.
_TRACED_NAME = re.compile(r"jit\((?:[^()]|\([^()]*\))*\)/")


def produced_by_odmlq(tflite: bytes) -> bool:
    """Whether a .tflite looks made by odmlq: it has a quantized tensor named
    after a traced op (``jit(...)/module/op``).

    A heuristic (a .tflite carries no odmlq metadata): a float model, or one
    converted by another tool, has no such tensor. A quantized JAX model
    converted by litert-converter without odmlq may pass it; `odmlq.report.device_report`
    then finds no plan edge in it and says so.
    """
    for d in preserving_interpreter(tflite).get_tensor_details():
        q = d["quantization_parameters"]
        if d["dtype"] in (np.int8, np.int16) and q["scales"].size and _TRACED_NAME.search(d["name"]):
            return True
    return False


def _ordered(inputs: Mapping[str, np.ndarray] | list, details: list) -> list:
    """Input arrays in the model's order: by input name, else by position.

    Raises:
      OdmlqError: not as many arrays as the model has inputs.
    """
    if len(inputs) != len(details):
        given = ", ".join(inputs) if isinstance(inputs, Mapping) else f"{len(inputs)} array(s)"
        raise OdmlqError(f"The model takes {len(details)} input(s) "
                         f"({', '.join(repr(d['name']) for d in details)}); the inputs hold {given}. "
                         "Give one array per model input, in order.")
    if not isinstance(inputs, Mapping):
        return list(inputs)
    values = list(inputs.values())
    return [inputs[d["name"]] if d["name"] in inputs else values[i] for i, d in enumerate(details)]


def dump_tensors(tflite: bytes, inputs: Mapping[str, np.ndarray] | list) -> dict[str, np.ndarray]:
    """Runs the model once and returns every tensor it computes, by name.

    `inputs`: arrays in the order of the model's inputs, or by input name.

    Raises:
      OdmlqError: inputs that do not fit the model (naming the input and the
        shape it takes).
    """
    interpreter = preserving_interpreter(tflite)
    details = interpreter.get_input_details()
    for d, x in zip(details, _ordered(inputs, details)):
        if tuple(np.shape(x)) != tuple(d["shape"]):
            raise OdmlqError(f"Input {d['name']!r} has shape {tuple(np.shape(x))}; the model takes "
                             f"{tuple(int(s) for s in d['shape'])}. Give inputs of that shape.")
        interpreter.set_tensor(d["index"], np.asarray(x).astype(d["dtype"]))
    interpreter.invoke()
    produced = produced_tensors(interpreter)
    by_index = {d["index"]: d for d in interpreter.get_tensor_details()}
    return {by_index[i]["name"]: np.array(interpreter.get_tensor(i)) for i in dict.fromkeys(produced)}


def diff_device(tflite: bytes, inputs, dump: Mapping[str, np.ndarray], *,
                outputs_only: bool | None = None) -> DeviceDiff:
    """Compares a device dump with the host interpreter, tensor by tensor.

    Args:
      tflite: the model the device ran.
      inputs: its inputs (in order, or by input name).
      dump: the device's tensors by name (or ``t<index>``).
      outputs_only: compare the model's outputs only (default: when the
        .tflite is not made by odmlq, see `produced_by_odmlq`).

    Raises:
      OdmlqError: inputs that do not fit the model; a dumped tensor of another shape.
    """
    if outputs_only is None:
        outputs_only = not produced_by_odmlq(tflite)
    host = dump_tensors(tflite, inputs)
    interpreter = preserving_interpreter(tflite)
    details = {d["name"]: d for d in interpreter.get_tensor_details()}
    outputs = {d["index"] for d in interpreter.get_output_details()}
    diffs, missing = [], []
    for name, expected in host.items():
        d = details[name]
        if outputs_only and d["index"] not in outputs:
            continue
        key = name if name in dump else f"t{d['index']}"
        if key not in dump:
            missing.append(name)
            continue
        got = np.asarray(dump[key])
        if got.shape != expected.shape:
            raise OdmlqError(f"Tensor {name!r} is {got.shape} in the dump but {expected.shape} in the model; "
                             "was the dump made from this .tflite on these inputs?")
        diffs.append(_tensor_diff(d, name, expected, got, d["index"] in outputs))
    parted = next((t for t in diffs if t.nan or (t.max_lsb is not None and t.max_lsb > _PART_LSB)
                   or (t.max_lsb is None and t.sqnr_db < 60)), None)
    return DeviceDiff(tensors=tuple(diffs), missing=tuple(missing), parted_at=parted, outputs_only=outputs_only)


def _tensor_diff(d: dict, name: str, expected: np.ndarray, got: np.ndarray, is_output: bool) -> TensorDiff:
    scales = d["quantization_parameters"]["scales"]
    lsb = None
    a, b = expected.astype(np.float64), got.astype(np.float64)
    if np.issubdtype(expected.dtype, np.integer) and scales.size:
        lsb = float(np.max(np.abs(a - b), initial=0.0))
        zp = d["quantization_parameters"]["zero_points"].astype(np.float64)
        shape = [1] * a.ndim
        if scales.size > 1:
            shape[d["quantization_parameters"]["quantized_dimension"]] = -1
        a = (a - zp.reshape(shape)) * scales.reshape(shape)
        b = (b - zp.reshape(shape)) * scales.reshape(shape)
    finite = np.isfinite(b)  # NaN on the device: counted, left out of the SQNR
    noise = float(np.sum(np.where(finite, a - b, 0.0) ** 2))
    signal = float(np.sum(a ** 2))
    sqnr = math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal else -math.inf)
    return TensorDiff(index=d["index"], name=name, dtype=str(expected.dtype), sqnr_db=sqnr,
                      max_lsb=lsb, is_output=is_output, nan=int(b.size - np.count_nonzero(finite)))


def check_model_inputs(names: list[str], arrays: list, example_inputs: tuple) -> None:
    """Inputs fit the model: as many as it takes, its example inputs' shapes but for the batch.

    Raises:
      OdmlqError: naming the input, its shape and the shape the model takes.
    """
    if len(arrays) != len(example_inputs):
        raise OdmlqError(f"The model takes {len(example_inputs)} input(s); the inputs hold "
                         f"{len(arrays)} ({', '.join(names)}). Give one array per model input, in order.")
    for name, x, example in zip(names, arrays, example_inputs):
        want, got = tuple(np.shape(example)), tuple(np.shape(x))
        if len(got) != len(want) or got[1:] != want[1:]:
            raise OdmlqError(f"Input {name!r} has shape {got}; the model takes "
                             f"{('N',) + want[1:]} (any batch size N). Give inputs of that shape.")


def output_value(value: np.ndarray, detail: dict) -> np.ndarray:
    """An output as float (an integer output dequantized with its scale)."""
    return from_output(np.asarray(value), detail)
