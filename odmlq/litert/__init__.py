"""The LiteRT backend: export full-integer .tflite flatbuffers, verify and inspect them."""

from odmlq.litert._convert import ConversionError
from odmlq.litert.export import Export, FloatOpsError, check_plan, export_tflite
from odmlq.litert._runtime import VERBOSE_ENVIRONMENT, interpreter
from odmlq.litert.spec import TARGET
from odmlq.litert.inspect import ModelFileError, ModelSummary, OpInfo, TensorInfo, format_summary, inspect
from odmlq.litert.verify import EdgeCheck, LiteRTCrashError, VerificationError, VerificationReport, verify

__all__ = [
    "ConversionError", "EdgeCheck", "VERBOSE_ENVIRONMENT", "LiteRTCrashError", "Export", "FloatOpsError", "ModelFileError", "ModelSummary",
    "OpInfo", "TARGET", "TensorInfo", "VerificationError", "VerificationReport", "check_plan",
    "export_tflite", "format_summary", "inspect", "interpreter", "verify",
]
