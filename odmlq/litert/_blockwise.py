"""int4 weights in blocks for XNNPACK's blockwise kernel (internal).

XNNPACK runs a dynamic-range FULLY_CONNECTED whose int4 weight carries
``BlockwiseQuantization`` (the flatbuffer's quantization details: a float16
scales tensor of shape (out, in / block), the block size) on its qd8 x qb4w
kernels: the input quantized to int8 per row at run time, each block of 32k
weights with its own scale (measured here: one partition; float32 scales are
refused at prepare, bfloat16 ones are misread).

litert-converter 0.5.0 lowers a blockwise ``quant.fake_quant`` (its
``block_shape`` attribute) to ``tfl.blockwise_dequantize``, which its
flatbuffer writer then cannot write. So the export annotates such a weight
per output channel (`placeholder`: the largest block scale of each channel),
which the converter turns into the same hybrid FULLY_CONNECTED with an int4
per-channel weight, and `write_blockwise` then puts the plan's block integers
and scales into that tensor. Simulate and XLA compute with the same block
scales, rounded up by the plan to values float16 and bfloat16 both hold
(`QuantSpec.scale_dtype`): the file stores float16, and XNNPACK reads bfloat16.
"""

from __future__ import annotations

import dataclasses

import flatbuffers
import numpy as np
from ai_edge_litert import schema_py_generated as schema

from odmlq.litert._convert import ConversionError
from odmlq.litert._repair import FILE_IDENTIFIER, aligned_buffers

__all__ = ["Blockwise", "int4_bytes", "payload", "placeholder", "write_blockwise"]


@dataclasses.dataclass(frozen=True)
class Blockwise:
    """One weight's blocks in the kernel's layout: int codes (out, in), float16 scales (out, in / block)."""

    param: str
    codes: np.ndarray
    scales: np.ndarray
    block_size: int


def placeholder(ts):
    """A per-output-channel int4 scale for the annotation (the largest block scale of each channel)."""
    scale = np.max(np.asarray(ts.scale), axis=ts.block_axis, keepdims=True)
    return dataclasses.replace(ts, scale=scale, zero_point=None, block_axis=None, block_size=None)


def payload(param: str, on_grid: np.ndarray, ts, input_axis: int, output_axis: int) -> Blockwise:
    """The weight's integers and scales, transposed to (out, in), from its values on the block grid."""
    expanded = np.repeat(np.asarray(ts.scale, np.float32), ts.block_size, axis=ts.block_axis)
    codes = np.rint(np.asarray(on_grid, np.float32) / expanded).astype(np.int8)
    scales = np.asarray(ts.scale, np.float32)
    return Blockwise(param=param, codes=np.transpose(codes, (output_axis, input_axis)),
                     scales=np.transpose(scales, (output_axis, input_axis)).astype(np.float16),
                     block_size=int(ts.block_size))


def int4_bytes(codes: np.ndarray) -> np.ndarray:
    """int4 codes two to a byte, the first in the low nibble (LiteRT's packing)."""
    flat = codes.reshape(-1).astype(np.int16)
    if flat.size % 2:
        flat = np.append(flat, 0)
    return ((flat[0::2] & 0xF) | ((flat[1::2] & 0xF) << 4)).astype(np.uint8)


def write_blockwise(tflite: bytes, weights: list[Blockwise], subgraph: int = 0) -> bytes:
    """The model with each weight's int4 tensor in `subgraph` (a signature's) given
    its block integers and a float16 scales tensor (`BlockwiseQuantization`).

    Raises:
      ConversionError: a weight's int4 tensor is not in the file once (named
        after its parameter, shaped (out, in)).
    """
    if not weights:
        return tflite
    model = schema.ModelT.InitFromPackedBuf(bytearray(tflite), 0)
    graph = model.subgraphs[subgraph]
    for w in weights:
        found = [i for i, t in enumerate(graph.tensors)
                 if t.type == schema.TensorType.INT4 and w.param in (t.name or b"").decode()
                 and tuple(t.shape) == w.codes.shape]
        if len(found) != 1:
            raise ConversionError(
                f"The converted model has {len(found)} int4 tensors of shape {w.codes.shape} named after "
                f"weight {w.param!r} (1 expected), so its block scales cannot be written; quantize it "
                "per channel (PerChannel()) instead.")
        tensor = graph.tensors[found[0]]
        model.buffers[tensor.buffer].data = int4_bytes(w.codes)
        scales_buffer = schema.BufferT()
        scales_buffer.data = np.frombuffer(w.scales.tobytes(), np.uint8)
        model.buffers.append(scales_buffer)
        scales = schema.TensorT()
        scales.shape, scales.type = list(w.scales.shape), schema.TensorType.FLOAT16
        scales.buffer, scales.name = len(model.buffers) - 1, f"{w.param}/block_scales".encode()
        graph.tensors.append(scales)
        details = schema.BlockwiseQuantizationT()
        details.scales, details.zeroPoints, details.blockSize = len(graph.tensors) - 1, -1, w.block_size
        quantization = schema.QuantizationParametersT()
        quantization.detailsType, quantization.details = schema.QuantizationDetails.BlockwiseQuantization, details
        tensor.quantization = quantization
    model.buffers = aligned_buffers(model.buffers)
    builder = flatbuffers.Builder(len(tflite) + 1024)
    builder.Finish(model.Pack(builder), file_identifier=FILE_IDENTIFIER)
    return bytes(builder.Output())
