"""The LiteRT backend: export full-integer .tflite flatbuffers, verify and inspect them."""

from odmlq.litert._convert import ConversionError
from odmlq.litert.export import Export, FloatOpsError, check_plan, export_tflite
from odmlq.litert._runtime import VERBOSE_ENVIRONMENT, interpreter
from odmlq.litert.signatures import Signature, SignatureExport, export_signatures
from odmlq.litert.spec import TARGET
from odmlq.litert.speed import DelegateError, Delegation, Latency, delegation, interleaved_latency
from odmlq.litert.inspect import ModelFileError, ModelSummary, OpInfo, TensorInfo, format_summary, inspect
from odmlq.litert.verify import EdgeCheck, LiteRTCrashError, VerificationError, VerificationReport, verify

__all__ = [
    "ConversionError", "DelegateError", "Delegation", "EdgeCheck", "Latency", "VERBOSE_ENVIRONMENT", "LiteRTCrashError", "Export", "FloatOpsError", "ModelFileError", "ModelSummary",
    "OpInfo", "Signature", "SignatureExport", "TARGET", "TensorInfo", "VerificationError", "VerificationReport", "check_plan",
    "delegation", "export_signatures", "export_tflite", "format_summary", "inspect", "interleaved_latency", "interpreter", "verify",
]
