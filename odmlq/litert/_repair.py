"""Repairs what litert-converter 0.5.0 writes wrong for int16 ops (internal).

Two repairs: the bias of int16x8 convolutions (below), and the
``pot_scale_int16`` option of int16 ADD and SUB (`repair_int16_add_sub`).

Why this is needed:
  In the int16x8 schema (int16 activations, int8 weights) LiteRT's
  convolution kernels take an int64 bias. litert-converter 0.5.0 writes the
  bias of CONV_2D, DEPTHWISE_CONV_2D and TRANSPOSE_CONV as an int32 tensor
  and leaves the ops' ``quantized_bias_type`` option unset, which tells the
  kernels to expect int64. The model converts without an error, but:

  - CONV_2D reads the int32 bias array as int64 values: channel c gets
    ``b[2c] + b[2c+1] * 2**32`` (saturating its output) and the second half
    of the channels read past the array's end, so the outputs are wrong by
    the whole output range (a bias-free convolution gets a zero int32 bias
    and is just as wrong in its second half of channels);
  - DEPTHWISE_CONV_2D is refused by ``allocate_tensors``
    (``depthwise_conv.cc: bias->type != kTfLiteInt64 (INT32 != INT64)``).

  `repair_int16_conv_bias` rewrites each such bias as an int64 tensor holding
  the same integers, with the same scales and zero points, which is what the
  LiteRT quantization spec prescribes for 16x8 convolutions. FULLY_CONNECTED
  reads either bias type in 16x8 and is left alone. TRANSPOSE_CONV has the
  same bias option as CONV_2D and is treated alike (litert-converter 0.5.0
  emitted no integer TRANSPOSE_CONV in our tests: it keeps it in float).

Speed: LiteRT runs a 16x8 CONV_2D with an int64 bias in its reference kernel
(no optimized kernel takes an int64 bias; XNNPACK delegated no int16 op here),
about 60x slower than its optimized 16x8 kernel. That kernel reads an int32
bias, declared in the op's ``quantized_bias_type``, but accumulates in int32:
with ``int32_bias_when_exact=True`` a CONV_2D keeps its int32 bias (declared)
wherever no accumulator can overflow, and gets the int64 bias elsewhere.

Only `numpy`, `flatbuffers` and the flatbuffer schema shipped with
`ai_edge_litert` are used.
"""

from __future__ import annotations

import copy

import flatbuffers
import numpy as np
from ai_edge_litert import schema_py_generated as schema

__all__ = ["FILE_IDENTIFIER", "aligned_buffers", "repair_int16_conv_bias", "int16_conv_bias_problems",
           "int16_add_sub_problems", "repair_int16_add_sub"]

FILE_IDENTIFIER = b"TFL3"
# The schema asks for 16-byte aligned buffer data (`force_align: 16`); the
# generated Python writer aligns it to 1 byte only.
_BUFFER_ALIGNMENT = 16

_Op = schema.BuiltinOperator
_T = schema.TensorType
# Builtin operator -> (index of the activation input, index of the bias input).
_CONVOLUTIONS = {
    _Op.CONV_2D: (0, 2),
    _Op.DEPTHWISE_CONV_2D: (0, 2),
    _Op.TRANSPOSE_CONV: (2, 3),
}
_OP_NAMES = {v: k for k, v in vars(_Op).items() if not k.startswith("_")}


class _AlignedBufferT(schema.BufferT):
    """A `BufferT` whose data is written 16-byte aligned."""

    def Pack(self, builder):  # noqa: N802 (the generated API's name)
        data = None
        if self.data is not None:
            payload = np.asarray(self.data, dtype=np.uint8).reshape(-1)
            builder.StartVector(1, payload.size, _BUFFER_ALIGNMENT)
            builder.head -= payload.size
            builder.Bytes[builder.head:builder.head + payload.size] = payload.tobytes()
            data = builder.EndVector()
        schema.BufferStart(builder)
        if data is not None:
            schema.BufferAddData(builder, data)
        schema.BufferAddOffset(builder, self.offset)
        schema.BufferAddSize(builder, self.size)
        return schema.BufferEnd(builder)


def aligned_buffers(buffers) -> list[_AlignedBufferT]:
    """The model's buffers, each written 16-byte aligned when packed."""
    return [_aligned(b) for b in buffers or []]


def _aligned(buffer: schema.BufferT) -> _AlignedBufferT:
    out = _AlignedBufferT()
    out.data, out.offset, out.size = buffer.data, buffer.offset, buffer.size
    return out


def _builtin_code(model: schema.ModelT, op: schema.OperatorT) -> int:
    code = model.operatorCodes[op.opcodeIndex]
    # Codes above 127 live only in `builtinCode`; older files only in the
    # deprecated int8 field.
    return max(int(code.builtinCode), int(code.deprecatedBuiltinCode))


def _targets(model: schema.ModelT) -> list[tuple[int, int, int, int]]:
    """(subgraph, op, bias slot, bias tensor) of every 16x8 convolution with an int32 bias."""
    found = []
    for s, subgraph in enumerate(model.subgraphs or []):
        tensors = subgraph.tensors or []
        for o, op in enumerate(subgraph.operators or []):
            slots = _CONVOLUTIONS.get(_builtin_code(model, op))
            if slots is None:
                continue
            inputs = list(op.inputs if op.inputs is not None else [])
            act, bias = slots
            if len(inputs) <= bias or inputs[act] < 0 or inputs[bias] < 0:
                continue
            if tensors[inputs[act]].type != _T.INT16 or tensors[inputs[bias]].type != _T.INT32:
                continue
            declared = getattr(op.builtinOptions, "quantizedBiasType", _T.FLOAT32)
            if declared == _T.INT32:
                continue  # the kernel is told to read int32: nothing to repair
            found.append((s, o, bias, int(inputs[bias])))
    return found


def int16_conv_bias_problems(tflite: bytes) -> list[str]:
    """Describes the int16x8 convolutions of `tflite` whose bias is int32.

    Args:
      tflite: a LiteRT flatbuffer.

    Returns:
      One line per convolution (subgraph, op index and name, bias tensor), in
      model order; empty when there is nothing to repair.
    """
    model = schema.ModelT.InitFromPackedBuf(bytearray(tflite), 0)
    lines = []
    for s, o, _, t in _targets(model):
        op = model.subgraphs[s].operators[o]
        name = model.subgraphs[s].tensors[t].name
        lines.append(f"subgraph {s} op {o} ({_OP_NAMES.get(_builtin_code(model, op), '?')}): "
                     f"int32 bias tensor {t} ({name.decode(errors='replace') if name else ''})")
    return lines


def _tensor_uses(subgraph: schema.SubGraphT) -> dict[int, int]:
    """How many times each tensor index is referenced in a subgraph."""
    uses: dict[int, int] = {}
    lists = [subgraph.inputs, subgraph.outputs]
    for op in subgraph.operators or []:
        lists += [op.inputs, op.outputs, op.intermediates]
    for indices in lists:
        for t in (indices if indices is not None else []):
            if t >= 0:
                uses[int(t)] = uses.get(int(t), 0) + 1
    return uses


def _buffer_uses(model: schema.ModelT) -> dict[int, int]:
    """How many tensors and metadata entries reference each buffer."""
    uses: dict[int, int] = {}
    for subgraph in model.subgraphs or []:
        for tensor in subgraph.tensors or []:
            uses[tensor.buffer] = uses.get(tensor.buffer, 0) + 1
    refs = [m.buffer for m in (model.metadata or [])]
    refs += [int(b) for b in (model.metadataBuffer if model.metadataBuffer is not None else [])]
    for b in refs:
        uses[b] = uses.get(b, 0) + 1
    return uses


def _as_int64(tensor: schema.TensorT, buffer: schema.BufferT, where: str) -> np.ndarray:
    """The tensor's int32 values as little-endian int64 bytes."""
    if buffer.offset > 1 or buffer.size:
        raise NotImplementedError(
            f"{where}: the bias data is stored outside the flatbuffer (offset {buffer.offset}); "
            "models over 2 GB are not supported by this repair.")
    if buffer.data is None or len(buffer.data) == 0:
        raise ValueError(f"{where}: the int32 bias is not a constant; it cannot be rewritten.")
    raw = np.asarray(buffer.data, dtype=np.uint8).tobytes()
    count = int(np.prod(tensor.shape)) if tensor.shape is not None else 1
    if len(raw) != 4 * count:
        raise ValueError(f"{where}: the bias holds {len(raw)} bytes for {count} int32 values.")
    values = np.frombuffer(raw, dtype="<i4").astype("<i8")
    return np.frombuffer(values.tobytes(), dtype=np.uint8)


_INT32_MAX = 2**31 - 1


def _int32_accumulation_is_exact(model: schema.ModelT, subgraph: int, op_index: int) -> bool:
    """Whether a 16x8 CONV_2D can keep its int32 bias and run LiteRT's optimized kernel.

    That kernel accumulates ``sum(x * w) + bias`` in int32. With int16 inputs
    of zero point 0 (|x| <= 32768) and int8 weights of zero point 0, no partial
    sum can overflow when, for every output channel c,
    ``32768 * sum(|w[c]|) + |bias[c]| <= 2**31 - 1``.
    """
    op = model.subgraphs[subgraph].operators[op_index]
    tensors = model.subgraphs[subgraph].tensors
    if (_builtin_code(model, op) != _Op.CONV_2D
            or not hasattr(op.builtinOptions, "quantizedBiasType")):
        return False
    x, w, b = (tensors[int(i)] for i in op.inputs[:3])
    if w.type != _T.INT8 or any(
            t.quantization is not None and t.quantization.zeroPoint is not None
            and np.any(t.quantization.zeroPoint) for t in (x, w)):
        return False
    w_data, b_data = model.buffers[w.buffer].data, model.buffers[b.buffer].data
    if w_data is None or b_data is None or len(w_data) == 0 or w.shape is None:
        return False
    weights = np.frombuffer(bytes(w_data), np.int8).astype(np.int64)
    channels = int(w.shape[0])
    bias = np.abs(np.frombuffer(bytes(b_data), "<i4").astype(np.int64))
    if weights.size % channels or bias.size != channels:
        return False
    bound = 32768 * np.abs(weights.reshape(channels, -1)).sum(axis=1) + bias
    return bool(np.all(bound <= _INT32_MAX))


def repair_int16_conv_bias(tflite: bytes, *, int32_bias_when_exact: bool = False) -> bytes:
    """Gives every int16x8 convolution of a LiteRT model the int64 bias its kernel reads.

    Each CONV_2D, DEPTHWISE_CONV_2D and TRANSPOSE_CONV whose activation input
    is int16 and whose bias is a constant int32 tensor gets that bias as an
    int64 tensor with the same integer values, shape, name and quantization
    (scales, zero points, quantized dimension). Everything else in the model
    is kept as it is. A bias buffer that other tensors also reference is
    copied, not changed in place, and a bias tensor that other ops (or the
    subgraph's inputs and outputs) also read is duplicated for the
    convolutions, so no other reader sees a changed type.

    Args:
      tflite: a LiteRT flatbuffer (``.tflite`` bytes).
      int32_bias_when_exact: a CONV_2D whose int32 accumulation provably
        cannot overflow (see `_int32_accumulation_is_exact`) keeps its int32
        bias, declared in its ``quantized_bias_type`` option, and runs
        LiteRT's optimized 16x8 kernel instead of the reference one. Off by
        default: the int64 bias is what the quantization spec prescribes.

    Returns:
      The repaired flatbuffer; `tflite` itself (the same bytes) when there is
      nothing to repair.

    Raises:
      ValueError: a bias to repair is not a constant, or its data does not
        match its shape.
      NotImplementedError: the bias data is stored after the flatbuffer
        (models over 2 GB).

    Example:
      >>> tflite = repair_int16_conv_bias(converted)
      >>> Interpreter(model_content=tflite).allocate_tensors()
    """
    # (Read in place: a large model's bytes are not copied to find nothing to repair.)
    model = schema.ModelT.InitFromPackedBuf(tflite, 0)
    targets = _targets(model)
    if not targets:
        return tflite
    model = schema.ModelT.InitFromPackedBuf(bytearray(tflite), 0)  # a copy its repairs write into
    if int32_bias_when_exact:
        kept = [tg for tg in targets if _int32_accumulation_is_exact(model, tg[0], tg[1])]
        for s, o, _, _ in kept:
            model.subgraphs[s].operators[o].builtinOptions.quantizedBiasType = _T.INT32
        targets = [tg for tg in targets if tg not in kept]
    if any(b.offset > 1 for b in model.buffers or []):
        raise NotImplementedError(
            "The model stores buffers after the flatbuffer (models over 2 GB); repacking it "
            "would move them. This repair supports models under 2 GB.")

    # 1. Tensors: repaired in place when only the convolutions' bias slots read
    #    them, otherwise duplicated for those slots.
    repaired: dict[tuple[int, int], int] = {}  # (subgraph, old tensor) -> int64 tensor
    slots_per_tensor: dict[tuple[int, int], int] = {}
    for s, _, _, t in targets:
        slots_per_tensor[(s, t)] = slots_per_tensor.get((s, t), 0) + 1
    uses = {s: _tensor_uses(model.subgraphs[s]) for s in {s for s, *_ in targets}}
    for (s, t), slots in slots_per_tensor.items():
        subgraph = model.subgraphs[s]
        if uses[s].get(t, 0) == slots:
            repaired[(s, t)] = t
        else:
            subgraph.tensors.append(copy.deepcopy(subgraph.tensors[t]))
            repaired[(s, t)] = len(subgraph.tensors) - 1
    for s, o, slot, t in targets:
        model.subgraphs[s].operators[o].inputs[slot] = repaired[(s, t)]

    # 2. Buffers: rewritten in place when only repaired tensors reference them,
    #    otherwise copied as int64 (one copy per original buffer).
    buffer_uses = _buffer_uses(model)
    new_tensors = [(s, model.subgraphs[s].tensors[t]) for (s, _), t in repaired.items()]
    readers: dict[int, int] = {}
    for _, tensor in new_tensors:
        readers[tensor.buffer] = readers.get(tensor.buffer, 0) + 1
    int64_buffer: dict[int, int] = {}
    for s, tensor in new_tensors:
        old = tensor.buffer
        if old not in int64_buffer:
            where = f"subgraph {s}, bias tensor {tensor.name!r}"
            data = _as_int64(tensor, model.buffers[old], where)
            if buffer_uses.get(old, 0) == readers[old]:
                model.buffers[old].data = data
                int64_buffer[old] = old
            else:
                model.buffers.append(schema.BufferT())
                model.buffers[-1].data = data
                int64_buffer[old] = len(model.buffers) - 1
        tensor.buffer = int64_buffer[old]
        tensor.type = _T.INT64

    return _packed(model, len(tflite))


def _packed(model: schema.ModelT, size: int) -> bytes:
    """`model` as flatbuffer bytes, its buffers 16-byte aligned."""
    model.buffers = aligned_buffers(model.buffers)
    builder = flatbuffers.Builder(size + 1024)
    builder.Finish(model.Pack(builder), file_identifier=FILE_IDENTIFIER)
    return bytes(builder.Output())


# ADD and SUB options, by builtin operator: (options class, its union tag).
_ADD_SUB = {
    _Op.ADD: (schema.AddOptionsT, schema.BuiltinOptions.AddOptions),
    _Op.SUB: (schema.SubOptionsT, schema.BuiltinOptions.SubOptions),
}


def _add_sub_targets(model: schema.ModelT) -> list[tuple[int, int]]:
    """(subgraph, op) of every int16 ADD or SUB that may take LiteRT's power-of-two path."""
    found = []
    for s, subgraph in enumerate(model.subgraphs or []):
        tensors = subgraph.tensors or []
        for o, op in enumerate(subgraph.operators or []):
            if _builtin_code(model, op) not in _ADD_SUB:
                continue
            outputs = list(op.outputs if op.outputs is not None else [])
            if not outputs or outputs[0] < 0 or tensors[outputs[0]].type != _T.INT16:
                continue
            if op.builtinOptions is not None and not getattr(op.builtinOptions, "potScaleInt16", True):
                continue
            found.append((s, o))
    return found


def int16_add_sub_problems(tflite: bytes) -> list[str]:
    """Describes the int16 ADD and SUB ops of `tflite` left on LiteRT's power-of-two path.

    Args:
      tflite: a LiteRT flatbuffer.

    Returns:
      One line per op (subgraph, op index and name, output tensor), in model
      order; empty when there is nothing to repair.
    """
    model = schema.ModelT.InitFromPackedBuf(bytearray(tflite), 0)
    lines = []
    for s, o in _add_sub_targets(model):
        op = model.subgraphs[s].operators[o]
        name = model.subgraphs[s].tensors[op.outputs[0]].name
        lines.append(f"subgraph {s} op {o} ({_OP_NAMES.get(_builtin_code(model, op), '?')}): "
                     f"pot_scale_int16 set, output {name.decode(errors='replace') if name else ''}")
    return lines


def repair_int16_add_sub(tflite: bytes) -> bytes:
    """Sends every int16 ADD and SUB of a LiteRT model down the kernels' general path.

    Why: ADD and SUB options carry ``pot_scale_int16``, true by default and
    left so by litert-converter 0.5.0. With it set, LiteRT's int16 kernels
    take a path written for LSTM cells whenever all three scales are within
    0.1% of a power of two and the zero points are 0: inputs are only
    shifted, never rescaled, and an input whose scale is above the output's
    is refused at allocation (``sub.cc: data->input1_shift <= 0 was not
    true``). Scales land there by chance: a 0/1 mask in int16 has the scale
    1/32767, within 0.001 of 2**-15 in log2. The general path (what the
    quantization spec and `odmlq.simulate` compute) rescales each input with
    a multiplier, for any scales. This sets ``pot_scale_int16`` false on
    every ADD and SUB with an int16 output; everything else is kept.

    Args:
      tflite: a LiteRT flatbuffer (``.tflite`` bytes).

    Returns:
      The repaired flatbuffer; `tflite` itself (the same bytes) when no int16
      ADD or SUB is on the power-of-two path.

    Raises:
      NotImplementedError: the model stores buffers after the flatbuffer
        (models over 2 GB).
    """
    if not _add_sub_targets(schema.ModelT.InitFromPackedBuf(tflite, 0)):
        return tflite
    model = schema.ModelT.InitFromPackedBuf(bytearray(tflite), 0)
    if any(b.offset > 1 for b in model.buffers or []):
        raise NotImplementedError(
            "The model stores buffers after the flatbuffer (models over 2 GB); repacking it "
            "would move them. This repair supports models under 2 GB.")
    for s, o in _add_sub_targets(model):
        op = model.subgraphs[s].operators[o]
        if op.builtinOptions is None:
            options, tag = _ADD_SUB[_builtin_code(model, op)]
            op.builtinOptions, op.builtinOptionsType = options(), tag
        op.builtinOptions.potScaleInt16 = False
    return _packed(model, len(tflite))
