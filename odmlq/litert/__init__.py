"""The LiteRT backend: read .tflite flatbuffers."""

from odmlq.litert.inspect import ModelSummary, OpInfo, TensorInfo, format_summary, inspect

__all__ = ["ModelSummary", "OpInfo", "TensorInfo", "format_summary", "inspect"]
