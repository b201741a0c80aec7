import odmlq

# API changes show up in review: update this list on purpose.
EXPECTED = [
    "AbsMax", "Calibration", "CalibrationError", "Edge", "EdgePlan", "Entropy", "FixedRange",
    "GPTQ", "GranularityError", "Graph", "MSE", "MinMax", "MovingAverageMinMax", "Nearest", "OdmlqError", "Op",
    "OpPlan", "Operand", "PerBlock", "PerChannel", "PerTensor", "Percentile", "Plan",
    "PlanError", "QArray", "QType", "QTypeError", "QuantSpec", "RMS", "Rule", "RuleError",
    "Statistics", "TraceError", "UnmatchedRuleWarning", "WeightPlan", "compute_scale",
    "fake_quant", "load_rules", "plan", "qtype", "quantize", "quantize_tensor", "trace",
    "calibrate", "Scales", "TensorScale", "compute_scales", "Simulator", "simulate",
    "export_tflite", "VerificationError", "Report", "compare",
    "ptq", "QuantizedModel", "quantize_params", "save_params", "load_params",
    "autotune", "Candidate", "TuneResult", "TuneTarget", "keras_quantized", "QAT", "qat", "LoRA", "lora",
    "Signature", "SignatureExport", "export_signatures", "AWQResult", "awq", "INT8", "FULL_INTEGER_INT8",
]


def test_public_api_snapshot():
    assert sorted(odmlq.__all__) == sorted(EXPECTED)
    for name in odmlq.__all__:
        assert hasattr(odmlq, name), name


def test_errors_derive_from_the_builtin_they_resemble():
    assert issubclass(odmlq.RuleError, ValueError) and issubclass(odmlq.RuleError, odmlq.OdmlqError)
    assert issubclass(odmlq.TraceError, RuntimeError)
