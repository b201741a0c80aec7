"""Weights stored after the flatbuffer, for exports of large models (internal).

Two limits stop a large model at the converter's door. A flatbuffer cannot
pass 2 GB (its offsets are 32-bit). And a weight handed over as a constant is
held three times over: the float parameter, its hex text in the StableHLO
the converter parses, and the converter's own copy.

So with external weights, each quantized weight reaches the converter as a
placeholder: zeros of its shape (a one-value constant in the text) inside its
quantization composite. The converter writes the tensor, its scales and the
integer kernels that read it as usual, but with a buffer of zeros.
`externalized` then gives each such tensor a buffer stored after the
flatbuffer. These are the schema's ``Buffer.offset`` and ``Buffer.size``,
counted from the start of the file; LiteRT reads them from a file or from
bytes alike. The weight's integers are written there one weight at a time,
computed as the converter computes them from the plan's values on the grid:
round(value / scale) + zero point.

A placeholder is found in the converted file by its tensor's name (the
parameter path the annotation scopes it under), shape and integer type.
A weight the file does not hold where expected is an error, never a
model with zeros in it.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
from collections.abc import Callable, Sequence

import flatbuffers
import numpy as np
from ai_edge_litert import schema_py_generated as schema

from odmlq.litert._blockwise import int4_bytes
from odmlq.litert._convert import ConversionError
from odmlq.litert._repair import FILE_IDENTIFIER, aligned_buffers

__all__ = ["Placeholder", "externalized", "EXTERNAL_AUTO_BYTES"]

# Exports whose quantized weights hold more float32 bytes than this use
# external weights unless told otherwise (`export_tflite(external_weights=)`):
# their StableHLO text alone would be twice that.
EXTERNAL_AUTO_BYTES = 1 << 30
# Where the weights after the flatbuffer start (and each one after the
# previous): XNNPACK and LiteRT read weights in place, 64-byte aligned at most.
_ALIGNMENT = 64

_TYPES = {"int8": schema.TensorType.INT8, "int16": schema.TensorType.INT16, "int4": schema.TensorType.INT4}


@dataclasses.dataclass(frozen=True)
class Placeholder:
    """One weight handed to the converter as zeros.

    `codes()` gives its integers in the kernel's layout (`shape`), computed
    when they are written, so no more than one weight's integers are held
    at a time.
    """

    param: str
    shape: tuple[int, ...]
    qtype: str
    codes: Callable[[], np.ndarray]


def nbytes(shape: Sequence[int], qtype: str) -> int:
    """Bytes of a weight's integers in the file (int4: two to a byte)."""
    n = int(np.prod(shape, dtype=np.int64))
    return (n + 1) // 2 if qtype == "int4" else n * (2 if qtype == "int16" else 1)


def _file_bytes(codes: np.ndarray, qtype: str) -> np.ndarray:
    if qtype == "int4":
        return int4_bytes(codes)
    return np.ascontiguousarray(codes, "<i2" if qtype == "int16" else np.int8).view(np.uint8).reshape(-1)


def _tensor_name(param: str) -> re.Pattern:
    # (The converter numbers the names of a merged module's later signatures: composite1.)
    return re.compile(rf"jit\([^)]*\)/{re.escape(param)}/composite\d*")


def _matches(model: schema.ModelT, placeholder: Placeholder) -> list[tuple[int, int]]:
    """(subgraph, tensor) pairs holding the placeholder's weight."""
    name = _tensor_name(placeholder.param)
    return [(g, i) for g, graph in enumerate(model.subgraphs or []) for i, t in enumerate(graph.tensors or [])
            if t.type == _TYPES[placeholder.qtype] and tuple(t.shape) == tuple(placeholder.shape)
            and name.fullmatch((t.name or b"").decode())]


def externalized(held: list[bytes], placeholders: Sequence[Placeholder]) -> bytes:
    """The model with each placeholder's tensors reading a buffer after the
    flatbuffer that holds the weight's integers.

    `held`: a list holding the converted model's bytes, which it empties, so
    that they (as large as the weights' integers: the placeholders' zeros)
    are freed before the new file is read back.

    Raises:
      ConversionError: a placeholder's weight is not in the converted file as
        one tensor of its shape and type per subgraph that reads it, or its
        buffer has another size than its integers need.
    """
    tflite = held.pop()
    model = schema.ModelT.InitFromPackedBuf(tflite, 0)
    buffers = list(model.buffers)
    sizes: dict[int, int] = {}
    sources: dict[int, Callable[[], np.ndarray]] = {}
    claimed: dict[int, str] = {}
    matched, zeros = set(), set()  # the placeholders' tensors, the buffers they read (zeros)
    for p in placeholders:
        found = _matches(model, p)
        if not found:
            raise ConversionError(
                f"The converted model has no {p.qtype} tensor of shape {p.shape} named after weight {p.param!r}, "
                "so its integers cannot be written after the flatbuffer. Export with external_weights=False "
                "(the weights then go through the converter as constants).")
        matched.update(found)
        zeros.update(model.subgraphs[g].tensors[i].buffer for g, i in found)
        want = nbytes(p.shape, p.qtype)
        index = None
        for g, i in found:
            tensor = model.subgraphs[g].tensors[i]
            stored = _stored_bytes(buffers[tensor.buffer])
            if stored != want:
                raise ConversionError(
                    f"Weight {p.param!r}: the converted model stores {stored} bytes for it, not the "
                    f"{want} its {p.qtype} integers take; export with external_weights=False.")
            if index is None:
                # One buffer per weight: a buffer the converter shares between two
                # weights' placeholders (equal zeros, equal scales) is split.
                index = tensor.buffer if tensor.buffer not in claimed else len(buffers)
                if index == len(buffers):
                    buffers.append(schema.BufferT())
                claimed[index] = p.param
            tensor.buffer = index
        sizes[index] = want
        sources[index] = (lambda p=p: _file_bytes(np.asarray(p.codes()), p.qtype))
    _check_unmatched(model, buffers, placeholders, matched, zeros)
    # Buffers the file already stores after its flatbuffer move with the rest.
    for index, buffer in enumerate(buffers):
        if index not in sizes and buffer.data is None and buffer.offset > 1:
            if buffer.offset + buffer.size > len(tflite):
                raise ConversionError(f"The converted model is truncated: buffer {index} lies at bytes "
                                      f"{buffer.offset}..{buffer.offset + buffer.size} of {len(tflite)}.")
            sizes[index] = int(buffer.size)
            sources[index] = (lambda o=int(buffer.offset), n=int(buffer.size), src=tflite:
                              np.frombuffer(src, np.uint8, n, o))
    # Placeholder buffers no tensor reads any more (split above) hold nothing.
    read = {t.buffer for graph in model.subgraphs or [] for t in graph.tensors or []}
    for index, buffer in enumerate(buffers):
        if index not in read and index not in sizes:
            buffers[index] = schema.BufferT()
    for index in sizes:
        buffers[index] = schema.BufferT()
        buffers[index].offset, buffers[index].size = 1, sizes[index]  # 1: a non-default value of the same width
    offsets = {}
    packed = _pack(model, buffers)
    position = _aligned(len(packed))
    for index in sorted(sizes):
        offsets[index] = position
        position = _aligned(position + sizes[index])
    for index, offset in offsets.items():
        buffers[index].offset = offset
    final = _pack(model, buffers)
    if len(final) != len(packed):  # the offsets are fixed-width fields
        raise ConversionError("The flatbuffer changed size when its buffer offsets were written; "
                              "export with external_weights=False.")
    # What the flatbuffer holds is in `final`: the converted bytes can go
    # (unless buffers stored after its flatbuffer are still to be copied).
    del packed, model, buffers, tflite
    # The file is assembled on disk one weight at a time and read back once.
    with tempfile.TemporaryFile(prefix="odmlq-external-") as f:
        f.write(final)
        for index in sorted(sizes):
            data = sources[index]()
            if data.size != sizes[index]:
                raise ConversionError(f"Buffer {index}: {data.size} bytes computed for {sizes[index]} reserved.")
            f.seek(offsets[index])
            f.write(memoryview(data))
            del data
        f.truncate(position)
        f.seek(0)
        return f.read()


def _check_unmatched(model, buffers, placeholders, matched, zeros) -> None:
    """Another tensor that read a placeholder's zeros (the flatbuffer writer
    stores equal bytes once) keeps zeros of its own, unless it is named after
    a placeholder's weight: then it is a copy the converter derived from the
    weight (a transposed or reshaped kernel), which would hold zeros."""
    scopes = [(p.param, re.compile(rf"/{re.escape(p.param)}/")) for p in placeholders]
    for g, graph in enumerate(model.subgraphs or []):
        for i, tensor in enumerate(graph.tensors or []):
            if (g, i) in matched or tensor.buffer not in zeros:
                continue
            name = (tensor.name or b"").decode()
            named = [param for param, scope in scopes if scope.search(name)]
            if named:
                raise ConversionError(
                    f"The converted model holds weight {named[0]!r} also as tensor {name!r} (shape "
                    f"{tuple(tensor.shape)}), which the converter derived from it; its integers cannot be "
                    "written after the flatbuffer. Export with external_weights=False.")
            own = schema.BufferT()
            own.data = np.zeros(_stored_bytes(buffers[tensor.buffer]), np.uint8)
            buffers.append(own)
            tensor.buffer = len(buffers) - 1


def _stored_bytes(buffer: schema.BufferT) -> int:
    """A buffer's bytes, in the flatbuffer or after it."""
    return int(np.size(buffer.data)) if buffer.data is not None else int(buffer.size if buffer.offset > 1 else 0)


def _aligned(n: int) -> int:
    return -(-n // _ALIGNMENT) * _ALIGNMENT


def _pack(model: schema.ModelT, buffers) -> bytes:
    model.buffers = aligned_buffers(buffers)
    builder = flatbuffers.Builder(1 << 20)
    builder.Finish(model.Pack(builder), file_identifier=FILE_IDENTIFIER)
    return bytes(builder.Output())
