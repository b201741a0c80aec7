"""Int32 bias room and bias correction: the folded bias of a convolution, on every backend.

A small Linen CNN with BatchNorm, on inputs with a large mean (as images are
after a ReLU6), holds one "dead" channel: weights of 1e-7 and a zero running
variance, as the published EfficientNet-Lite0 checkpoint has. Folded, its
bias in accumulator units passes 2**31.
"""

import flax.linen as nn
import jax
import numpy as np
import pytest

import odmlq
from odmlq.algorithms import GPTQ, parse_weight_algorithm
from odmlq.calibration import Calibration
from odmlq.scales import BIAS_LIMIT


class _ConvBN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 3), use_bias=False, name="conv")(x)
        x = nn.BatchNorm(use_running_average=True, epsilon=1e-3, name="bn")(x)
        x = nn.relu6(x)
        x = nn.Conv(8, (3, 3), feature_group_count=8, use_bias=False, name="depthwise")(x)
        x = nn.BatchNorm(use_running_average=True, epsilon=1e-3, name="bn2")(x)
        return nn.Dense(4, name="head")(x.mean(axis=(1, 2)))


@pytest.fixture(scope="module")
def conv_bn():
    model = _ConvBN()
    rng = np.random.default_rng(0)
    x = (rng.uniform(0, 6, (64, 12, 12, 3))).astype(np.float32)
    variables = jax.tree_util.tree_map(np.asarray, model.init(jax.random.key(0), x[:1]))
    variables = jax.tree_util.tree_map(np.array, variables)
    variables["params"]["conv"]["kernel"][..., 5] = 1e-7  # the dead channel
    variables["batch_stats"]["bn"]["var"][5] = 0.0
    variables["params"]["bn"]["bias"][5] = -4.0
    variables["batch_stats"]["bn"]["mean"] = rng.uniform(-1, 1, 8).astype(np.float32)
    return model, variables, x


def test_a_dead_channel_bias_fits_int32_and_the_export_verifies(conv_bn, tmp_path):
    """Without room the folded bias of channel 5 is 4 / (6/255 x 2.8e-5 / 127)
    = 7.7e11 accumulator units: the converter saturates it and LiteRT's
    channel is off by the whole bias (seen: 114 LSB on EfficientNet-Lite0)."""
    model, variables, x = conv_bn
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", weight_algorithm=odmlq.Nearest())]
    export = odmlq.export_tflite(model, rules, [x[i:i + 16] for i in range(0, 64, 16)],
                                 tmp_path / "m.tflite", variables=variables)
    assert export.verification.passed
    plan, scales = export.plan, export.scales
    conv = next(op for op in plan.graph.ops if op.module_path == "conv")
    in_scale = float(np.asarray(scales.input_scale(plan, conv, conv.inputs[0]).scale).reshape(-1)[0])
    w_scale = np.asarray(scales.weights["conv/kernel"].scale).reshape(-1)
    # bias b s + t of the folded BatchNorm, channel 5: -4 - mean * gamma / sqrt(eps)
    bn = variables["params"]["bn"], variables["batch_stats"]["bn"]
    folded = bn[0]["bias"] - bn[1]["mean"] * bn[0]["scale"] / np.sqrt(bn[1]["var"] + 1e-3)
    assert np.all(np.abs(folded) / (in_scale * w_scale) <= BIAS_LIMIT * (1 + 1e-6))
    assert w_scale[5] > 1e3 * np.abs(variables["params"]["conv"]["kernel"][..., 5]).max() / 127


def test_bias_correction_takes_back_the_average_output_error(conv_bn):
    """Weight-only int4, float activations: the corrected depthwise output's
    mean error per channel over the calibration data is float32 rounding
    (1e-4 of its spread), where rounding to nearest leaves 1e-2 or more."""
    model, variables, x = conv_bn
    errors = {}
    for correct in (False, True):
        rules = [odmlq.Rule("depthwise", weight_qtype="int4",
                            weight_algorithm=GPTQ(bias_correction=correct)),
                 odmlq.Rule(".*", skip=True)]
        plan = odmlq.plan(model, rules, x[:1], variables=variables)
        calibration = odmlq.calibrate(model, plan, [x], variables=variables, progress=False)
        scales = odmlq.compute_scales(plan, calibration, variables)
        edge = next(op for op in plan.graph.ops if op.module_path == "depthwise").outputs[0]
        _, quantized = odmlq.simulate(model, plan, scales, x, variables=variables, capture=True)
        empty = odmlq.compute_scales(odmlq.plan(model, [odmlq.Rule(".*", skip=True)], x[:1],
                                                variables=variables), None, variables)
        _, exact = odmlq.simulate(model, plan, empty, x, variables=variables, capture=True)
        diff = np.asarray(quantized[edge], np.float64) - np.asarray(exact[edge], np.float64)
        errors[correct] = np.abs(diff.mean(axis=(0, 1, 2))) / np.asarray(exact[edge]).std()
    assert errors[False].max() > 1e-2, errors[False]
    assert errors[True].max() < 1e-4, errors[True]


def test_bias_correction_is_written_in_the_plan_and_the_saved_calibration(conv_bn, tmp_path):
    model, variables, x = conv_bn
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8",
                        weight_algorithm=GPTQ(bias_correction=True))]
    plan = odmlq.plan(model, rules, x[:1], variables=variables)
    again = odmlq.Plan.from_json(plan.to_json())
    assert all(s.algorithm.bias_correction for s in again.weight_specs().values() if s.algorithm)
    calibration = odmlq.calibrate(model, plan, [x], variables=variables, progress=False)
    path = tmp_path / "c.npz"
    calibration.save(path)
    loaded = Calibration.load(path)
    for param, gram in calibration.grams.items():
        np.testing.assert_allclose(loaded.grams[param].total, gram.total, rtol=1e-12)
    first = odmlq.compute_scales(plan, calibration, variables)
    second = odmlq.compute_scales(plan, loaded, variables)
    assert first.shifts and set(first.shifts) == set(second.shifts)
    for op_id, shift in first.shifts.items():
        np.testing.assert_allclose(second.shifts[op_id], shift, rtol=1e-6)
    assert parse_weight_algorithm({"algorithm": "gptq", "bias_correction": True}).bias_correction


def test_bias_correction_field_must_be_a_bool():
    with pytest.raises(odmlq.RuleError, match=r"bias_correction='yes'.*True or False"):
        GPTQ(bias_correction="yes")


def test_xla_applies_the_same_bias_corrections_as_the_export(conv_bn, tmp_path):
    """Both read the shifts from the scales: XLA's output equals simulate's
    exactly (same integers, same folded biases), and the export's edges are
    verified within 1 LSB of simulate."""
    model, variables, x = conv_bn
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", weight_algorithm=GPTQ(bias_correction=True))]
    export = odmlq.export_tflite(model, rules, [x[i:i + 16] for i in range(0, 64, 16)],
                                 tmp_path / "m.tflite", variables=variables)
    qmodel = odmlq.ptq(model, export.plan, variables, export.calibration)
    assert export.scales.shifts and set(qmodel.scales.shifts) == set(export.scales.shifts)
    for op_id, shift in export.scales.shifts.items():
        np.testing.assert_array_equal(qmodel.scales.shifts[op_id], shift)
    simulated = odmlq.simulate(model, export.plan, export.scales, x[:8], variables=variables)
    np.testing.assert_array_equal(np.asarray(qmodel(x[:8])), np.asarray(simulated))
