"""Report.weights: per-channel weight ranges, outlier channels flagged and printed."""

import json

import numpy as np
import pytest

import odmlq
from odmlq.report import OUTLIER_RATIO, Report
from samples.models import mlp

PER_TENSOR = [odmlq.Rule(".*", weight_qtype="int8", weight_granularity=odmlq.PerTensor())]


@pytest.fixture(scope="module")
def planted():
    """The MLP with output channel 5 of dense1's kernel made 10x larger."""
    model, (x,), variables = mlp()
    kernel = np.array(variables["params"]["dense1"]["kernel"])
    kernel[:, 5] *= 10
    variables["params"]["dense1"]["kernel"] = kernel
    return model, x, variables


def _report(model, x, variables, rules):
    plan = odmlq.plan(model, rules, x, variables=variables)
    scales = odmlq.compute_scales(plan, None, variables)
    inputs = np.random.default_rng(0).random((8, *x.shape[1:]), np.float32)
    return odmlq.compare(model, plan, scales, inputs, variables=variables)


def test_an_outlier_channel_of_a_per_tensor_weight_is_flagged_with_the_levels_it_costs(planted):
    model, x, variables = planted
    report = _report(model, x, variables, PER_TENSOR)
    weights = {w.param: w for w in report.weights}
    assert set(weights) == {"dense1/kernel", "dense2/kernel", "head/kernel"}
    w = weights["dense1/kernel"]
    assert w.axis == 1 and len(w.min) == len(w.max) == 512 and w.outliers == (5,)
    assert w.module_path == "dense1" and "per-tensor" in w.spec and w.levels == 127
    kernel = np.asarray(variables["params"]["dense1"]["kernel"])
    np.testing.assert_allclose(w.max, kernel.max(axis=0), rtol=1e-6)
    np.testing.assert_allclose(w.min, kernel.min(axis=0), rtol=1e-6)
    # One channel 10x the others sets the one scale: the median channel uses about a tenth of the levels.
    expected = np.median(np.abs(kernel).max(axis=0)) / (np.abs(kernel).max() / 127)
    assert w.median_levels == pytest.approx(expected, abs=0.1) and w.median_levels < 127 / OUTLIER_RATIO
    assert weights["head/kernel"].outliers == () and weights["dense2/kernel"].outliers == ()
    text = str(report)
    assert "Weights with outlier channels" in text and "dense1/kernel" in text
    assert f"the median channel uses {w.median_levels:g} of 127 levels" in text and "head/kernel" not in text
    data = json.loads(report.to_json())["weights"]
    assert data[0]["param"] == "dense1/kernel" and data[0]["axis"] == 1 and data[0]["outliers"] == [5]
    assert Report.from_json(report.to_json()).weights == report.weights


def test_per_channel_weights_are_ranged_along_their_scale_axis(planted):
    model, x, variables = planted
    report = _report(model, x, variables, [odmlq.Rule(".*", weight_qtype="int8")])
    w = {w.param: w for w in report.weights}["dense1/kernel"]
    assert w.axis == 1 and w.outliers == (5,) and w.median_levels is None  # its own scale absorbs it


def test_a_model_without_outliers_says_so():
    model, (x,), variables = mlp()
    report = _report(model, x, variables, PER_TENSOR)
    assert all(w.outliers == () for w in report.weights)
    assert "weights: 3 quantized, no outlier channels" in str(report)


def test_a_block_that_one_weight_collapses_is_pointed_at(planted):
    """int4 in blocks of 32: one weight 200x its neighbours sets its block's scale and the
    other 31 round to 0. The report names that block (its flat index in the scale's
    shape) and no other; with blocks of 8 only a quarter of the block is left to vanish."""
    model, x, variables = planted
    kernel = np.array(variables["params"]["dense2"]["kernel"])  # (512, 256): 16 blocks per column
    column, block = 7, 3
    kernel[block * 32 + 5, column] = 200 * np.abs(kernel[block * 32:(block + 1) * 32, column]).max()
    variables = {"params": {**variables["params"], "dense2": {**variables["params"]["dense2"], "kernel": kernel}}}
    int4 = odmlq.Rule("dense2", weight_qtype="int4", weight_granularity=odmlq.PerBlock(32))
    report = _report(model, x, variables, [int4, odmlq.Rule(".*", weight_qtype="int8")])
    w = {w.param: w for w in report.weights}["dense2/kernel"]
    assert w.cells == 16 * 256
    assert w.collapsed == (block * 256 + column,)  # scale shape (16, 256), row-major
    assert all(not v.collapsed for v in report.weights if v.param != "dense2/kernel")
    text = str(report)
    assert "collapsed blocks or channels" in text and "1 of 4096 scale cells collapsed" in text
    assert Report.from_json(report.to_json()).weights == report.weights
    # Per output channel, the same weight collapses its whole channel.
    per_channel = odmlq.Rule("dense2", weight_qtype="int4")
    w = {w.param: w for w in _report(model, x, variables, [per_channel]).weights}["dense2/kernel"]
    assert w.cells == 256 and w.collapsed == (column,)
