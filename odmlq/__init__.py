"""odmlq: quantize JAX/Flax models once, for XLA serving and full-integer LiteRT.

Write rules, trace the model into a Plan, and see exactly what each op, weight
and edge becomes before any backend runs:

  >>> import odmlq
  >>> p = odmlq.plan(model, [odmlq.Rule('.*', weight_qtype='int8', act_qtype='int8')], x)
  >>> print(p)
"""

from odmlq.algorithms import GPTQ, Nearest
from odmlq.awq import AWQResult, awq
from odmlq.calibration import (
    RMS,
    MSE,
    AbsMax,
    Calibration,
    Entropy,
    FixedRange,
    MinMax,
    MovingAverageMinMax,
    Percentile,
    Statistics,
)
from odmlq.errors import (
    CalibrationError,
    GranularityError,
    OdmlqError,
    PlanError,
    QTypeError,
    RuleError,
    TraceError,
)
from odmlq.granularity import PerBlock, PerChannel, PerTensor
from odmlq.graph import Edge, Graph, Op, Operand, trace
from odmlq.plan import EdgePlan, OpPlan, Plan, QuantSpec, WeightPlan
from odmlq.qarray import QArray, compute_scale, fake_quant, quantize, quantize_tensor
from odmlq.qtypes import QType, qtype
from odmlq.rules import FULL_INTEGER_INT8, INT8, Rule, UnmatchedRuleWarning, load_rules
from odmlq.calibration import calibrate
from odmlq.scales import Scales, TensorScale, compute_scales
from odmlq.simulate import Simulator, simulate
from odmlq.litert import Signature, SignatureExport, VerificationError, export_signatures, export_tflite
from odmlq.xla import QuantizedModel, load_params, quantize_params, save_params
from odmlq.targets import plan, ptq
from odmlq.keras_quantized import keras_quantized
from odmlq.report import Report, compare
from odmlq.report.tune import Candidate, TuneResult, TuneTarget, autotune
from odmlq.training import QAT, LoRA, lora, qat

__version__ = "0.1.0"

__all__ = [
    "AbsMax", "Calibration", "CalibrationError", "Edge", "EdgePlan", "Entropy", "FixedRange",
    "AWQResult", "GPTQ", "GranularityError", "Graph", "MSE", "MinMax", "MovingAverageMinMax", "Nearest", "OdmlqError",
    "Op", "awq",
    "OpPlan", "Operand", "PerBlock", "PerChannel", "PerTensor", "Percentile", "Plan",
    "PlanError", "QArray", "QType", "QTypeError", "QuantSpec", "RMS", "Rule", "RuleError",
    "Statistics", "TraceError", "UnmatchedRuleWarning", "WeightPlan", "compute_scale",
    "fake_quant", "load_rules", "plan", "qtype", "quantize", "quantize_tensor", "trace",
    "calibrate", "Scales", "TensorScale", "compute_scales", "Simulator", "simulate",
    "export_tflite", "VerificationError", "Report", "compare",
    "ptq", "QuantizedModel", "quantize_params", "save_params", "load_params",
    "autotune", "Candidate", "TuneResult", "TuneTarget", "keras_quantized", "QAT", "qat", "LoRA", "lora",
    "Signature", "SignatureExport", "export_signatures", "INT8", "FULL_INTEGER_INT8",
]
