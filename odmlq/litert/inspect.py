"""Reads a .tflite flatbuffer, without running it, into a summary of its ops and tensors.

The summary answers what an export must be checked for: which ops run in
float between the input QUANTIZE and the output DEQUANTIZE (float islands),
which weights are dequantized or transposed at every invocation, how the
tensors are quantized, and how many bytes the weights take.

Only the main subgraph (subgraph 0, the one the interpreter runs) is
summarized; the decomposition subgraphs of STABLEHLO_COMPOSITE ops are not.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
import struct

import numpy as np
from ai_edge_litert import schema_py_generated as schema

from odmlq.litert._mapping import INPUT_LAYOUT as _INPUT_LAYOUT
from odmlq.errors import OdmlqError
from odmlq.litert._summary_text import format_summary
from odmlq.litert._islands import (constant_derived, dynamic_kernel_inputs, dynamic_kernel_outputs,
                                   float_island_reason, is_dynamic_kernel, sources)

_FILE_IDENTIFIER = b"TFL3"
_DTYPE_NAMES = {v: k.lower() for k, v in vars(schema.TensorType).items() if not k.startswith("_")}
_OP_NAMES = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
# `jit(name)/` with at most one level of parentheses inside, e.g. `jit(<lambda>)/`.
_JIT_PREFIX = re.compile(r"jit\((?:[^()]|\([^()]*\))*\)/")


class ModelFileError(OdmlqError, ValueError):
    """A model file is missing, unreadable, or not a .tflite flatbuffer."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorInfo:
    """One tensor of the main subgraph, as the flatbuffer stores it.

    `quantized_dimension` is None for a tensor without quantization
    parameters; for a per-tensor quantized tensor it is what the file stores
    (0). `nbytes` counts the constant buffer as stored: int4 weights are
    packed two to a byte.
    """

    index: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    scales: tuple[float, ...]
    zero_points: tuple[int, ...]
    quantized_dimension: int | None
    nbytes: int
    is_constant: bool
    # Blockwise quantization (an int4 weight of XNNPACK's blockwise kernel):
    # the block size along the last axis; `scales` then holds the (float16)
    # block scales, row by row.
    block_size: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpInfo:
    """One operator of the main subgraph.

    `inputs` keeps the flatbuffer's -1 for an omitted optional input (a
    FULLY_CONNECTED without bias), as the interpreter reports it.
    `module_path` comes from the op's output tensor names (see
    `module_path_from_tensor_name`), or from its weights' names when the
    outputs were renamed as graph outputs; None when no name carries one.
    """

    index: int
    name: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    module_path: str | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSummary:
    """What a .tflite file contains; `print(summary)` shows it as tables.

    Attributes:
      ops: Operators in execution order.
      tensors: Tensors by index.
      inputs: Tensor indices of the graph inputs.
      outputs: Tensor indices of the graph outputs.
      signatures: Signature key -> {'inputs': {name: tensor index}, 'outputs': {...}}.
      op_histogram: Op name -> count, most frequent first.
      schema: What the file computes in, as `export_tflite` names schemas:
        'static' (integer activations: full integer, perhaps with float
        islands), 'dynamic' (float activations, integer weights read by
        hybrid kernels that quantize activations at run time),
        'weight_only' (weights dequantized for float kernels) or 'float'.
      float_islands: Ops that compute in float inside an integer graph; see
        `inspect`. Always empty for the other schemas, which compute in
        float by design.
      dynamic_kernels: In a full-integer graph, the matmuls and convolutions
        that read a float input, quantize it at run time and write a float
        output against int8 weights (dynamic-range kernels: a classifier head
        computed into float outputs from an int8 edge); not float islands.
      weight_bytes: Bytes of all constant buffers (a shared buffer counted once).
      file_bytes: Size of the whole file, offset buffers included.
    """

    ops: tuple[OpInfo, ...]
    tensors: tuple[TensorInfo, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    signatures: dict[str, dict]
    op_histogram: dict[str, int]
    schema: str
    float_islands: tuple[OpInfo, ...]
    weight_bytes: int
    file_bytes: int
    dynamic_kernels: tuple[OpInfo, ...] = ()

    @property
    def weight_work_at_run_time(self) -> tuple[OpInfo, ...]:
        """DEQUANTIZE or TRANSPOSE ops whose data input is computed from
        constants only, and QUANTIZE ops of such an input larger than every
        activation tensor.

        Such an op redoes the same work on a weight at every invocation (a
        QUANTIZE requantizes a whole table to the scale of the op reading
        it); a weight stored in the kernel's own layout, type and scale needs
        none. A small constant requantized where a shared-scale op reads it
        (a class token concatenated with the patches) costs less than any
        activation op, and is not counted.
        """
        derived = _constant_derived(self.ops, self.tensors)
        largest = max((math.prod(t.shape) for t in self.tensors
                       if not t.is_constant and t.index not in derived), default=0)
        return tuple(op for op in self.ops if op.inputs[0] in derived and (
            op.name in ("DEQUANTIZE", "TRANSPOSE")
            or op.name == "QUANTIZE" and math.prod(self.tensors[op.inputs[0]].shape) > largest))

    def why_float(self, op: OpInfo) -> str | None:
        """Why `op` is a float island (see `inspect`), or None when it is not one."""
        if self.schema != "static":
            return None
        derived = _constant_derived(self.ops, self.tensors)
        return float_island_reason(op, self.tensors, sources(self.ops, self.tensors, self.inputs), self.outputs,
                                   derived, *_dynamic_kernel_tensors(self.ops, self.tensors, derived))

    def __str__(self) -> str:
        return format_summary(self)


def _dynamic_kernel_tensors(ops, tensors, derived) -> tuple[frozenset[int], frozenset[int]]:
    return dynamic_kernel_inputs(ops, tensors, derived), dynamic_kernel_outputs(ops, tensors, derived)


def module_path_from_tensor_name(name: str) -> str | None:
    """Recovers the module path of the op that produced a tensor from its name.

    The converter names a tensor after the MLIR location of the op that made
    it, and jax's location is `jit(fn)/<named scopes>/<primitive>`. A fused op
    gets several locations joined by `;`. The first location that starts with
    `jit(...)/` decides; the converter's own bare names (`max`) carry no scope
    and are skipped. The path is what lies between `jit(...)/` and the last
    `/`: the named scopes without the primitive.

    Args:
      name: A tensor name from the flatbuffer.

    Returns:
      The module path; '' for an op at the top level; None when no location
      carries a `jit(...)/` prefix (graph inputs and outputs).

    Example:
      >>> module_path_from_tensor_name('jit(f)/dense1/dot_general/dot_general;max')
      'dense1/dot_general'
    """
    for location in name.split(";"):
        match = _JIT_PREFIX.match(location)
        if match:
            path = location[match.end():].rpartition("/")[0]
            # An op's input laid out for its kernel (`_mapping.INPUT_LAYOUT`) is the op's.
            return "/".join(p for p in path.split("/") if p != _INPUT_LAYOUT)
    return None


def inspect(model: bytes | str | os.PathLike) -> ModelSummary:
    """Summarizes a .tflite flatbuffer without running it.

    A float island is an op that computes in float between the input
    QUANTIZE and the output DEQUANTIZE of a full-integer model:
      * any op but QUANTIZE and DEQUANTIZE with a float (float16, float32,
        float64, bfloat16) input or output;
      * a DEQUANTIZE of a constant, or of a tensor computed from constants
        only (a weight dequantized at run time: float compute follows);
      * a DEQUANTIZE whose output is not a graph output, unless only
        dynamic-range kernels read it;
      * a QUANTIZE of a float tensor that is not a graph input (a QUANTIZE
        from an integer tensor is a requantization and stays integer).
    A dynamic-range kernel quantizes its float input at run time: it is in
    `ModelSummary.dynamic_kernels`, not an island.
    A CAST of integer (or bool) tensors to float (an attention mask, positions)
    is where they enter the float domain, as a graph input does: neither it nor
    the QUANTIZE of its output is an island.

    Args:
      model: The flatbuffer's bytes, or the path of a .tflite file.

    Returns:
      The summary of the main subgraph.

    Raises:
      ModelFileError: The file is missing, or is not a .tflite flatbuffer.

    Example:
      >>> summary = inspect('model.tflite')
      >>> [op.name for op in summary.float_islands]
      []
    """
    buf, label = _load(model)
    if len(buf) < 8 or buf[4:8] != _FILE_IDENTIFIER:
        raise ModelFileError(
            f"{label} is not a .tflite flatbuffer: bytes 4..8 are {bytes(buf[4:8])!r}, expected the "
            f"file identifier {_FILE_IDENTIFIER!r}; pass a file written by the LiteRT converter")
    try:
        return _read(buf, label)
    except ModelFileError:
        raise
    # The generated reader fails with whatever struct or numpy raise on an offset out of range.
    except (IndexError, struct.error, TypeError, ValueError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{label} has the .tflite identifier but is truncated or corrupt "
                             f"({e}); re-export the model") from e


def _load(model: bytes | str | os.PathLike) -> tuple[bytes, str]:
    if isinstance(model, (bytes, bytearray, memoryview)):
        return bytes(model), f"the given model bytes ({len(model)} bytes)"
    label = f"model file {os.fspath(model)!r}"
    try:
        with open(model, "rb") as f:
            return f.read(), label
    except OSError as e:
        raise ModelFileError(f"cannot read {label}: {e.strerror or e}; expected the path of an "
                             f"existing .tflite file") from e


def _read(buf: bytes, label: str) -> ModelSummary:
    model = schema.Model.GetRootAs(buf, 0)
    if model.SubgraphsLength() == 0:
        raise ModelFileError(f"{label} has no subgraph; expected a model with at least one")
    graph = model.Subgraphs(0)
    tensors, buffer_bytes = [], {}
    for i in range(graph.TensorsLength()):
        tensor = graph.Tensors(i)
        nbytes = _buffer_bytes(model, tensor.Buffer(), len(buf), label)
        is_constant = nbytes > 0 and not tensor.IsVariable()
        if is_constant:
            buffer_bytes[tensor.Buffer()] = nbytes
        tensors.append(_tensor_info(i, tensor, nbytes if is_constant else 0, is_constant))
    tensors = [_with_block_scales(t, graph.Tensors(t.index), model, graph) for t in tensors]
    ops = []
    for i in range(graph.OperatorsLength()):
        op = graph.Operators(i)
        ops.append(OpInfo(index=i, name=_op_name(model.OperatorCodes(op.OpcodeIndex())),
                          inputs=tuple(_indices(op.InputsAsNumpy())),
                          outputs=tuple(_indices(op.OutputsAsNumpy())), module_path=None))
    derived = _constant_derived(ops, tensors)
    ops = [dataclasses.replace(op, module_path=_op_module_path(op, tensors, derived)) for op in ops]
    inputs, outputs = tuple(_indices(graph.InputsAsNumpy())), tuple(_indices(graph.OutputsAsNumpy()))
    schema_name = _schema(ops, tensors, derived)
    entering = sources(ops, tensors, inputs)
    kernel_tensors = _dynamic_kernel_tensors(ops, tensors, derived)
    histogram = collections.Counter(op.name for op in ops)
    return ModelSummary(
        ops=tuple(ops), tensors=tuple(tensors), inputs=inputs, outputs=outputs,
        signatures=_signatures(model),
        op_histogram=dict(sorted(histogram.items(), key=lambda kv: (-kv[1], kv[0]))),
        schema=schema_name,
        float_islands=tuple(op for op in ops if schema_name == "static"
                            and float_island_reason(op, tensors, entering, outputs, derived, *kernel_tensors)),
        dynamic_kernels=tuple(op for op in ops if schema_name == "static" and is_dynamic_kernel(op, tensors, derived)),
        weight_bytes=sum(buffer_bytes.values()), file_bytes=len(buf))


def _buffer_bytes(model, index: int, file_bytes: int, label: str) -> int:
    """Bytes of a buffer, stored inline or, for large models, after the flatbuffer."""
    if not 0 < index < model.BuffersLength():  # buffer 0 is the empty sentinel
        return 0
    buffer = model.Buffers(index)
    if buffer.DataLength():
        return buffer.DataLength()
    # Offsets count from the start of the file; 0 and 1 mean "no offset buffer",
    # as in the interpreter's own reader.
    offset, size = buffer.Offset(), buffer.Size()
    if offset > 1 and size > 0:
        if offset + size > file_bytes:
            raise ModelFileError(
                f"{label} is truncated: buffer {index} lies at bytes {offset}..{offset + size} "
                f"but the file has {file_bytes} bytes; copy the whole file")
        return size
    return 0


def _tensor_info(index: int, tensor, nbytes: int, is_constant: bool) -> TensorInfo:
    q = tensor.Quantization()
    scales = () if q is None or q.ScaleIsNone() else tuple(float(s) for s in q.ScaleAsNumpy())
    zero_points = () if q is None or q.ZeroPointIsNone() else tuple(int(z) for z in q.ZeroPointAsNumpy())
    return TensorInfo(
        index=index, name=(tensor.Name() or b"").decode(),
        dtype=_DTYPE_NAMES.get(tensor.Type(), f"type{tensor.Type()}"),
        shape=tuple(_indices(tensor.ShapeAsNumpy())), scales=scales, zero_points=zero_points,
        quantized_dimension=q.QuantizedDimension() if scales else None,
        nbytes=nbytes, is_constant=is_constant)


def _with_block_scales(info: TensorInfo, tensor, model, graph) -> TensorInfo:
    """`info` with the block scales and size of a blockwise-quantized tensor."""
    q = tensor.Quantization()
    if q is None or q.DetailsType() != schema.QuantizationDetails.BlockwiseQuantization:
        return info
    details = schema.BlockwiseQuantization()
    details.Init(q.Details().Bytes, q.Details().Pos)
    scales = graph.Tensors(details.Scales())
    dtype = {schema.TensorType.FLOAT16: np.float16, schema.TensorType.FLOAT32: np.float32}.get(scales.Type())
    data = model.Buffers(scales.Buffer()).DataAsNumpy()
    values = () if dtype is None or isinstance(data, int) else tuple(
        float(v) for v in np.frombuffer(data.tobytes(), dtype))
    return dataclasses.replace(info, scales=values, zero_points=(), quantized_dimension=0,
                               block_size=details.BlockSize())


_INTEGER_DTYPES = frozenset({"int8", "uint8", "int16"})

# The JAX primitives a LiteRT op is lowered from, to find the op's own
# location among the fused ones its output is named after (a CONV_2D with a
# folded BatchNorm and a ReLU is named 'relu/max;bn/sub;conv/conv_general_dilated').
_PRIMITIVES = {
    "CONV_2D": ("conv_general_dilated",), "DEPTHWISE_CONV_2D": ("conv_general_dilated",),
    "TRANSPOSE_CONV": ("conv_general_dilated",), "CONV_3D": ("conv_general_dilated",),
    "FULLY_CONNECTED": ("dot_general",), "BATCH_MATMUL": ("dot_general",),
    "ADD": ("add",), "SUB": ("sub",), "MUL": ("mul",), "DIV": ("div",),
    "MAX_POOL_2D": ("reduce_window_max",), "AVERAGE_POOL_2D": ("reduce_window_sum", "div"),
    "SUM": ("reduce_sum",), "MEAN": ("reduce_sum", "div"), "REDUCE_MAX": ("reduce_max",),
    "LOGISTIC": ("logistic",), "TANH": ("tanh",), "EXP": ("exp",), "RSQRT": ("rsqrt",),
    "SQRT": ("sqrt",), "GELU": ("erf", "tanh", "mul"), "CONCATENATION": ("concatenate",),
    "RESHAPE": ("reshape",), "TRANSPOSE": ("transpose",), "PAD": ("pad",), "GATHER": ("gather",),
}


# Ops whose integer outputs are their integer inputs' values, moved.
_MOVING_INTEGERS = frozenset({
    "GATHER", "GATHER_ND", "SELECT", "SELECT_V2", "RESHAPE", "SQUEEZE", "EXPAND_DIMS", "TRANSPOSE", "SLICE",
    "STRIDED_SLICE", "CONCATENATION", "BROADCAST_TO", "DEQUANTIZE"})


def _schema(ops, tensors, derived: set[int]) -> str:
    """'static', 'dynamic', 'weight_only' or 'float' (see `ModelSummary.schema`)."""
    def integer(i: int) -> bool:
        return i >= 0 and tensors[i].dtype in _INTEGER_DTYPES and bool(tensors[i].scales)

    # A STABLEHLO_COMPOSITE left in the graph is a quantization the
    # converter did not lower: the model was meant to compute in integers.
    # Ops that only move integers (an int8 table's rows gathered, then
    # dequantized, in a dynamic-range file) do not compute in them.
    if any(integer(i) and i not in derived for op in ops if op.name not in _MOVING_INTEGERS
           for i in (*op.inputs, *op.outputs)) or any(op.name == "STABLEHLO_COMPOSITE" for op in ops):
        return "static"
    if any(integer(i) for op in ops if op.name != "DEQUANTIZE" for i in op.inputs if i in derived):
        return "dynamic"
    if any(op.name == "DEQUANTIZE" and op.inputs[0] in derived for op in ops):
        return "weight_only"
    return "float"


def _op_module_path(op: OpInfo, tensors, derived: set[int]) -> str | None:
    """The module path of the op's own location in its outputs' names, else
    of its weights' names.

    A fused op's output is named after every location fused into it; the one
    whose primitive the op is lowered from is its own (`_PRIMITIVES`), else
    the first. The converter renames graph outputs
    (`serving_default_y_output`), which loses the scope of the op that
    computes them; its weights, created in the same scope, still carry it.
    """
    own = _PRIMITIVES.get(op.name, ())
    for i in (*op.outputs, *(i for i in op.inputs if i in derived)):
        if i < 0:
            continue
        first = None
        for location in tensors[i].name.split(";"):
            path = module_path_from_tensor_name(location)
            if path is not None and location.rpartition("/")[2].rstrip("0123456789") in own:
                return path
            first = path if first is None else first
        if first is not None:
            return first
    return None


def _op_name(code) -> str:
    # The int8 deprecated field saturates at 127; newer ops live in the int32 field.
    builtin = max(code.BuiltinCode(), code.DeprecatedBuiltinCode())
    if builtin == schema.BuiltinOperator.CUSTOM:
        return (code.CustomCode() or b"CUSTOM").decode()
    return _OP_NAMES.get(builtin, f"BUILTIN_{builtin}")


def _signatures(model) -> dict[str, dict]:
    out = {}
    for i in range(model.SignatureDefsLength()):
        sig = model.SignatureDefs(i)
        out[(sig.SignatureKey() or b"").decode()] = {
            "inputs": {sig.Inputs(j).Name().decode(): sig.Inputs(j).TensorIndex()
                       for j in range(sig.InputsLength())},
            "outputs": {sig.Outputs(j).Name().decode(): sig.Outputs(j).TensorIndex()
                        for j in range(sig.OutputsLength())}}
    return out


def _indices(array) -> list[int]:
    # The generated accessors return the int 0, not an empty array, for an absent vector.
    return [] if isinstance(array, int) else [int(v) for v in array]


def _constant_derived(ops, tensors) -> set[int]:
    """Tensors that are constants or computed from constants only (ops are in execution order)."""
    return constant_derived(((op.inputs, op.outputs) for op in ops), (x.index for x in tensors if x.is_constant))
