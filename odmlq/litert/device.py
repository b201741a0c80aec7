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
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping

import numpy as np

from odmlq._plan_table import table
from odmlq.errors import OdmlqError

__all__ = ["DeviceDiff", "TensorDiff", "diff_device", "dump_tensors"]

_PART_LSB = 1.0  # integer kernels may round differently by one step


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorDiff:
    index: int
    name: str
    dtype: str
    sqnr_db: float
    max_lsb: float | None
    is_output: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceDiff:
    tensors: tuple[TensorDiff, ...]
    missing: tuple[str, ...]
    parted_at: TensorDiff | None

    @property
    def output_sqnr_db(self) -> float:
        outs = [t.sqnr_db for t in self.tensors if t.is_output]
        return min(outs) if outs else math.inf

    def __str__(self) -> str:
        rows = [[str(t.index), t.name[:60], t.dtype, _db(t.sqnr_db),
                 "-" if t.max_lsb is None else f"{t.max_lsb:.1f}", "out" if t.is_output else ""]
                for t in self.tensors]
        lines = ["Device vs host interpreter, in execution order",
                 table(["#", "tensor", "dtype", "SQNR dB", "max LSB", ""], rows)]
        lines.append(f"device parts from host at: {self.parted_at.name} (tensor {self.parted_at.index})"
                     if self.parted_at else "device and host agree within 1 LSB on every tensor")
        lines.append(f"outputs: {_db(self.output_sqnr_db)} dB")
        if self.missing:
            lines.append(f"missing from the dump ({len(self.missing)}): " + ", ".join(self.missing))
        return "\n".join(lines)


def _db(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:.1f}"


def _interpreter(tflite: bytes):
    from ai_edge_litert.interpreter import Interpreter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        interpreter = Interpreter(model_content=bytes(tflite), experimental_preserve_all_tensors=True)
    interpreter.allocate_tensors()
    return interpreter


def dump_tensors(tflite: bytes, inputs: Mapping[str, np.ndarray] | list) -> dict[str, np.ndarray]:
    """Runs the model once and returns every tensor it computes, by name.

    `inputs`: arrays in the order of the model's inputs, or by input name.
    """
    interpreter = _interpreter(tflite)
    details = interpreter.get_input_details()
    arrays = [inputs[d["name"]] if isinstance(inputs, Mapping) and d["name"] in inputs
              else list(inputs.values())[i] if isinstance(inputs, Mapping) else inputs[i]
              for i, d in enumerate(details)]
    for d, x in zip(details, arrays):
        if tuple(np.shape(x)) != tuple(d["shape"]):
            raise OdmlqError(f"Input {d['name']!r} has shape {tuple(np.shape(x))}; the model takes "
                             f"{tuple(d['shape'])}.")
        interpreter.set_tensor(d["index"], np.asarray(x).astype(d["dtype"]))
    interpreter.invoke()
    produced = [int(t) for op in interpreter._get_ops_details() for t in op["outputs"]]
    by_index = {d["index"]: d for d in interpreter.get_tensor_details()}
    return {by_index[i]["name"]: np.array(interpreter.get_tensor(i)) for i in dict.fromkeys(produced)}


def diff_device(tflite: bytes, inputs, dump: Mapping[str, np.ndarray]) -> DeviceDiff:
    """Compares a device dump with the host interpreter, tensor by tensor."""
    host = dump_tensors(tflite, inputs)
    interpreter = _interpreter(tflite)
    details = {d["name"]: d for d in interpreter.get_tensor_details()}
    outputs = {d["index"] for d in interpreter.get_output_details()}
    diffs, missing = [], []
    for name, expected in host.items():
        d = details[name]
        key = name if name in dump else f"t{d['index']}"
        if key not in dump:
            missing.append(name)
            continue
        got = np.asarray(dump[key])
        if got.shape != expected.shape:
            raise OdmlqError(f"Tensor {name!r} is {got.shape} in the dump but {expected.shape} in the model; "
                             "was the dump made from this .tflite on these inputs?")
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
        noise, signal = float(np.sum((a - b) ** 2)), float(np.sum(a ** 2))
        sqnr = math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal else -math.inf)
        diffs.append(TensorDiff(index=d["index"], name=name, dtype=str(expected.dtype), sqnr_db=sqnr,
                                max_lsb=lsb, is_output=d["index"] in outputs))
    parted = next((t for t in diffs if (t.max_lsb is not None and t.max_lsb > _PART_LSB)
                   or (t.max_lsb is None and t.sqnr_db < 60)), None)
    return DeviceDiff(tensors=tuple(diffs), missing=tuple(missing), parted_at=parted)
