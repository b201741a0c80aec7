"""The XLA path against the LiteRT export of the same plan and calibration.

Both read one Plan and one Calibration; the plan (made for both targets, the
default) holds LiteRT's scale constraints, so they compute the same scales. Tolerances: full-integer outputs are
on the output edge's grid in both and may differ by rounding only: 1 LSB
(seen: 0 on all 100 images). Weight-only outputs differ by float32 noise
(seen: 129-132 dB SQNR; floor 100 dB). Dynamic-range LiteRT kernels pick
their own run-time quantization (per batch row, one image per invoke) where
the plan asks per tensor: 30 dB, the floor `export_tflite` verifies against,
and top-1 agreement >= 97% (one near-tie of the untrained MLP flips).
"""

import numpy as np
import pytest

import odmlq
from odmlq import Rule
from odmlq.calibration import needs_calibration
from samples.digits import batches, load_digits_splits
from samples.models import SAMPLES
from tests._runs import litert_rows

SCHEMAS = {
    "static": [Rule(".*", weight_qtype="int8", act_qtype="int8")],
    "weight_only": [Rule(".*", weight_qtype="int8")],
    "dynamic": [Rule(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)],
}


@pytest.fixture(scope="module")
def digits():
    return load_digits_splits()


def _sqnr_db(reference, other) -> float:
    return float(10 * np.log10(np.sum(reference**2) / max(np.sum((reference - other) ** 2), 1e-30)))


# Full-integer conversion takes seconds: the MLP's runs with -m slow.
CASES = [pytest.param(name, schema, id=f"{name}-{schema}",
                      marks=[pytest.mark.slow] if (name, schema) == ("mlp", "static") else [])
         for name in ("mlp", "cnn") for schema in SCHEMAS]


@pytest.mark.parametrize("name,schema", CASES)
def test_xla_outputs_agree_with_the_litert_export(name, schema, digits):
    model, _, variables = SAMPLES[name]()
    representative = batches(digits.x_calibration, 64)
    plan = odmlq.plan(model, SCHEMAS[schema], digits.x_calibration[:1], variables=variables)
    # Every schema reads the data: static edges' ranges, and the inputs GPTQ
    # (the default) rounds the weights against.
    assert needs_calibration(plan)
    calibration = odmlq.calibrate(model, plan, representative, variables=variables)
    export = odmlq.export_tflite(model, plan, representative, variables=variables, calibration=calibration,
                                 verify=False)
    qmodel = odmlq.ptq(model, plan, variables, calibration)
    x = digits.x_test[:100]
    y_litert, y_xla = litert_rows(export.tflite, x), np.asarray(qmodel(x))
    if schema == "dynamic":  # the kernels' own run-time quantization: near-ties of the untrained MLP may flip
        assert np.mean(y_litert.argmax(-1) == y_xla.argmax(-1)) >= 0.97
    else:
        np.testing.assert_array_equal(y_litert.argmax(-1), y_xla.argmax(-1))
    if schema == "static":
        lsb = float(np.asarray(qmodel.scales.edges[plan.graph.outputs[0]].scale).reshape(-1)[0])
        assert np.max(np.abs(y_litert - y_xla)) <= lsb * (1 + 1e-4)
    else:
        assert _sqnr_db(y_litert, y_xla) >= (100.0 if schema == "weight_only" else 30.0)
