"""compare(): per-edge metrics, local vs inherited error, on the trained digits CNN."""

import dataclasses
import json
import math

import numpy as np
import pytest

import odmlq
from odmlq.calibration import FixedRange
from odmlq.litert.spec import OP_SPEC
from odmlq.report import edge_metrics
from samples.digits import batches, load_digits_splits, train

INT8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


@pytest.fixture(scope="module")
def cnn():
    digits = load_digits_splits()
    model, variables = train("cnn", digits, seconds=20, max_steps=300)
    plan = odmlq.plan(model, INT8, digits.x_test[:1], variables=variables)
    calibration = odmlq.calibrate(model, plan, batches(digits.x_calibration, 32), variables=variables)
    return digits, model, variables, plan, calibration


def test_planted_fault_is_ranked_first_and_local(cnn):
    """One activation edge calibrated with a range 10x too small."""
    digits, model, variables, plan, calibration = cnn
    lo, hi = calibration.range("conv2/relu", "int8", symmetric=False)
    faulty = odmlq.Calibration(dict(calibration))
    faulty.observe("conv2/relu_fault", FixedRange(float(lo) / 10, float(hi) / 10), np.zeros(1))
    method, stats = faulty["conv2/relu_fault"]
    entries = dict(calibration)
    entries["conv2/relu"] = (method, stats)
    scales = odmlq.compute_scales(plan, odmlq.Calibration(entries), variables, OP_SPEC)
    report = odmlq.compare(model, plan, scales, digits.x_test[:64], variables=variables)
    first = report.edges[0]
    assert first.edge == "conv2/relu", str(report)
    local, total = first.runs["local"], first.runs["simulate"]
    # Local error dominates: the edge introduces (nearly) all the error it carries.
    assert local.sqnr_db < 15 and abs(local.sqnr_db - total.sqnr_db) < 1.0, str(report)
    assert local.clipped > 0.05  # a tenth of the range clips many values
    downstream = {e.edge: e for e in report.edges}["dense1/relu"]
    assert downstream.runs["local"].sqnr_db > 30 and downstream.runs["simulate"].sqnr_db < 15
    assert "inherited" in str(report) and "local" in str(report)


def test_compare_against_itself_is_exact(cnn):
    digits, model, variables, _, _ = cnn
    plan = odmlq.plan(model, [], digits.x_test[:1], variables=variables)
    scales = odmlq.compute_scales(plan, None, variables)
    report = odmlq.compare(model, plan, scales, digits.x_test[:16], variables=variables)
    assert report.edges
    for e in report.edges:
        for metrics in e.runs.values():
            assert metrics.sqnr_db == math.inf and metrics.max_abs == 0 and metrics.cosine == pytest.approx(1.0)
    assert all(m.sqnr_db == math.inf for m in report.outputs.values())


def test_litert_run_lines_up_with_simulate(cnn):
    digits, model, variables, _, _ = cnn
    result = odmlq.export_tflite(model, INT8, batches(digits.x_calibration, 32), variables=variables)
    report = odmlq.compare(model, result.plan, result.scales, digits.x_test[:32], variables=variables,
                           tflite=result.tflite)
    quantized = [e for e in report.edges if e.spec != "float"]
    assert quantized and all("litert" in e.runs for e in quantized)
    for e in quantized:  # the export is bit-exact with simulate on this model
        assert e.runs["litert"].sqnr_db == pytest.approx(e.runs["simulate"].sqnr_db, abs=0.01)
    data = json.loads(report.to_json())
    assert data["format"] == "odmlq.report" and len(data["edges"]) == len(report.edges)


def test_nan_is_reported_not_a_huge_error():
    ref = np.ones(8, np.float32)
    value = ref.copy()
    value[3] = np.nan
    m = edge_metrics(ref, value)
    assert m.nan == 1 and math.isfinite(m.max_abs) and m.max_abs == 0
