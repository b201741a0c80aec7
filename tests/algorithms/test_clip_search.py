"""GPTQ(clip_search=True): each scale cell's range searched against the calibration inputs
(AWQ's clip search), read alike by every backend."""

import dataclasses

import jax
import numpy as np
import pytest

import odmlq
from odmlq.calibration import Gram
from odmlq.graph import WeightLayout
from odmlq.scales import TensorScale
from odmlq.scales._clip import LOWEST, searched_scale


def _cell_errors(w, scale, block, h):
    """Output error ``d^T H_cell d`` of each (block, output column) cell of a (K, N) weight."""
    step = np.repeat(scale, block, axis=0)
    d = w - np.clip(np.round(w / step), -8, 7) * step  # int4, not narrow
    k, n = w.shape
    errors = np.zeros((k // block, n))
    for b in range(k // block):
        rows = slice(b * block, (b + 1) * block)
        errors[b] = np.einsum("in,ij,jn->n", d[rows], h[rows, rows], d[rows])
    return errors


def test_no_cell_loses_and_the_output_error_falls():
    """int4 in blocks of 32 of a (256, 48) weight (Gaussian, one weight 6x larger in a
    third of the cells): every cell's output error at the searched scale is at most the
    abs max's (ratio 1 is a candidate), the total falls by a fifth (at 4 bits, clipping
    a Gaussian block's tails pays; a block with an outlier gains less), and the ratios
    stay in [LOWEST, 1]."""
    rng = np.random.default_rng(0)
    k, n, block = 256, 48, 32
    w = rng.standard_normal((k, n))
    planted = rng.random((k // block, n)) < 1 / 3
    for b, c in zip(*np.nonzero(planted)):
        w[b * block + rng.integers(block), c] *= 6
    x = rng.standard_normal((2048, k)) @ (np.eye(k) + 0.3 * rng.standard_normal((k, k)) / np.sqrt(k))
    h = x.T @ x
    absmax = np.abs(w.reshape(k // block, block, n)).max(axis=1) / 7
    ts = TensorScale(qtype="int4", scale=absmax.astype(np.float32), scale_axes=(1,), block_axis=0, block_size=block)
    gram = Gram(matrix=h[None], rows=x.shape[0], layout=WeightLayout(out_axes=(1,), in_axes=(0,)),
                fourth=np.zeros(1))
    searched = searched_scale(w, ts, gram, "float32").astype(np.float64)
    before, after = _cell_errors(w, absmax, block, h), _cell_errors(w, searched, block, h)
    # Ratio 1 is the abs max's scale rounded to float32: equal up to that rounding.
    assert np.all(after <= before * (1 + 1e-6))
    assert np.sum(after) < 0.85 * np.sum(before)  # measured 0.80
    ratio = searched / absmax
    assert np.all(ratio <= 1 + 1e-6) and np.all(ratio >= LOWEST - 1e-6)


def test_the_searched_scales_reach_every_backend_and_the_plan_keeps_the_option():
    from tests.test_sums import Mlp

    x = np.random.default_rng(1).standard_normal((64, 640)).astype(np.float32)
    model = Mlp()
    variables = model.init(jax.random.key(0), x[:1])
    algorithm = odmlq.GPTQ(clip_search=True)
    rules = [odmlq.Rule(".*", op="dot_general", weight_qtype="int4", weight_granularity=odmlq.PerBlock(32),
                        act_qtype="int8", act_dynamic=True, weight_algorithm=algorithm)]
    plan = odmlq.plan(model, rules, x[:1], variables=variables)
    assert odmlq.Plan.from_json(plan.to_json()).weight_specs()["a/kernel"].algorithm == algorithm
    calibration = odmlq.calibrate(model, plan, [x], variables=variables, progress=False)
    searched = odmlq.compute_scales(plan, calibration, variables)
    plain = odmlq.compute_scales(odmlq.plan(model, [dataclasses.replace(rules[0], weight_algorithm=odmlq.GPTQ())], x[:1],
                                            variables=variables), calibration, variables)
    ratio = np.asarray(searched.weights["a/kernel"].scale) / np.asarray(plain.weights["a/kernel"].scale)
    assert np.all(ratio <= 1.0) and np.any(ratio < 1.0)  # some blocks clipped
    qmodel = odmlq.ptq(model, plan, variables, calibration)
    np.testing.assert_array_equal(np.asarray(jax.jit(qmodel.apply)(qmodel.params, x)),
                                  np.asarray(odmlq.simulate(model, plan, searched, x, variables=variables)))
    exported = odmlq.export_tflite(model, rules, [x[:8]], variables=variables, progress=False)
    assert exported.verification is None or exported.verification.passed


def test_clip_search_is_checked_like_the_other_options():
    with pytest.raises(odmlq.RuleError, match="clip_search"):
        odmlq.GPTQ(clip_search="yes")
