"""Scales: constant operands from their values, and scales shared across an op."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import odmlq
import odmlq.litert
from odmlq.scales import constant_scale

INT8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


@pytest.mark.parametrize("value", [0.0, 0.5, 3.0, -6.0, [0.5, -1.0, 2.0, 0.25, 3.0], [0.0, 0.0]],
                         ids=["zero", "half", "three", "minus_six", "quarter_grid", "zeros"])
def test_constant_on_a_power_of_two_grid_is_exact(value):
    v = np.asarray(value, np.float32)
    ts = constant_scale(v, "int8")
    assert ts.zero_point is None and ts.scale.shape == (1,) * v.ndim
    scale = float(ts.scale.reshape(-1)[0])
    assert scale > 0 and np.log2(scale) == np.round(np.log2(scale))
    np.testing.assert_array_equal(ts.fake_quant(jnp.asarray(v)), v)  # exact: integer times scale


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-100, 100, width=32).filter(lambda f: f == 0 or abs(f) > 1e-20),
                min_size=1, max_size=6))
def test_any_constant_is_within_half_a_step_and_its_largest_magnitude_is_kept(values):
    v = np.asarray(values, np.float32)
    ts = constant_scale(v, "int8")
    q = np.asarray(ts.fake_quant(jnp.asarray(v)))
    scale = float(ts.scale.reshape(-1)[0])
    np.testing.assert_array_less(np.abs(q - v), scale / 2 + 1e-6 * np.abs(v) + 1e-30)  # dequant(quant(x)) vs x
    i = int(np.argmax(np.abs(v)))
    np.testing.assert_allclose(q[i], v[i], rtol=1e-6)  # float32 formula


def test_non_finite_constant_is_refused():
    with pytest.raises(odmlq.PlanError, match="not finite"):
        constant_scale(np.array([1.0, np.inf], np.float32), "int8")


class _Concat(nn.Module):
    shared_input: bool = False

    @nn.compact
    def __call__(self, x):
        a, b = nn.Dense(4, name="a")(x), 0.1 * nn.Dense(2, name="b")(x)
        y = jnp.concatenate([a, b], axis=-1)
        return (y, b + 1.0) if self.shared_input else y


@pytest.mark.parametrize("shared_input", [False, True], ids=["sole_consumer", "other_consumer"])
def test_inputs_of_a_concatenation_take_its_scale(shared_input):
    """LiteRT's CONCATENATION reads its inputs at its output's scale; the
    converter folds the requantization into each producer it alone feeds."""
    model, x = _Concat(shared_input), np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    p = odmlq.plan(model, INT8, x[:1], variables=variables)
    calibration = odmlq.calibrate(model, p, [x], variables=variables)
    free = odmlq.compute_scales(p, calibration, variables)
    scales = odmlq.compute_scales(p, calibration, variables)
    out = scales.edges["a/concatenate"]
    assert scales.edges["a/dot_general"].scale == out.scale  # a feeds only the concatenation
    if shared_input:  # b also feeds the add: it keeps its own range
        assert scales.edges["b/mul"].scale == free.edges["b/mul"].scale != out.scale
    else:
        assert scales.edges["b/mul"].scale == out.scale
        np.testing.assert_array_equal(scales.edges["b/mul"].zero_point, out.zero_point)


def _softmax_model():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jax.nn.softmax(nn.Dense(8, name="d")(x), axis=-1)

    x = np.random.RandomState(0).rand(4, 8).astype(np.float32)
    model = Net()
    return model, model.init(jax.random.PRNGKey(0), x), x


@pytest.mark.parametrize("lo,hi,match", [
    (-3.4e38, 3.0, r"edge 'input_0' \(a model input, read by op 'd/dot_general', module 'd'\) gets the int8 "
                   r"scale 1.33e\+36: .*attention mask's finfo\(float32\).min"),
    (-3.4e38, 3.4e38, r"edge 'input_0' .* gets a int8 scale that is not finite"),
], ids=["finfo_min_mask", "overflow"])
def test_an_absurd_edge_scale_is_refused_before_any_backend(lo, hi, match):
    """The BERT mask case: finfo(float32).min calibrated as data (a SOFTMAX input
    scale of 1.3e36 aborted LiteRT's allocate_tensors, killing the process)."""
    model, variables, x = _softmax_model()
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", act_calibration=odmlq.FixedRange(lo, hi))]
    plan = odmlq.plan(model, rules, x[:1], variables=variables)
    calibration = odmlq.calibrate(model, plan, [x], variables=variables)
    with pytest.raises(odmlq.CalibrationError, match=match):
        odmlq.compute_scales(plan, calibration, variables)
    with pytest.raises(odmlq.CalibrationError, match=match):
        odmlq.export_tflite(model, plan, [x], variables=variables, calibration=calibration)


class _NormTwice(nn.Module):
    """A LayerNorm right after a LayerNorm: the second one's mean is within
    an input LSB of zero for every sample (float noise, ~1e-8)."""

    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(nn.Dense(16)(x))
        return nn.Dense(4)(nn.LayerNorm()(x))


def test_a_degenerate_edge_gets_a_grid_its_integer_kernel_can_produce():
    """The calibrated range of that mean (and of its square) would give a scale
    ~1e-10, on which simulate's float32 rounding is many LSBs and LiteRT's
    MEAN/MUL compute other integers (was: a 16-58 LSB VerificationError). The
    scale is floored 64x below the step the kernel's integer result moves in
    (input scale / count for a mean, product of scales for a square), so the
    export verifies on unseen inputs; normal edges keep their calibrated scale."""
    model = _NormTwice()
    rng = np.random.default_rng(0)
    batches = [rng.normal(size=(8, 10)).astype(np.float32) for _ in range(4)]
    variables = model.init(jax.random.key(0), batches[0][:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    result = odmlq.export_tflite(model, rules, batches, variables=variables)
    assert result.verification.passed
    scales = result.scales.edges
    mean_in = float(np.max(scales["LayerNorm_0/add_1"].scale))
    mean = float(np.max(scales["LayerNorm_1/mean"].scale))
    assert mean >= mean_in / 16 / 64 * 0.999  # floored: input scale / count / 64
    lo, hi = result.calibration.range("LayerNorm_1/mean", "int8", symmetric=False)
    assert float(np.max(hi) - np.min(lo)) < mean  # the calibrated range alone is narrower than one LSB
    # The LayerNorm is written two-pass (`graph/_norms`): no square of this mean is quantized.
    assert not any(e.startswith("LayerNorm_1/square_") for e in scales)
    # A normal edge is untouched: the first LayerNorm's mean keeps its calibrated scale.
    lo, hi = result.calibration.range("LayerNorm_0/mean", "int8", symmetric=False)
    assert float(np.max(scales["LayerNorm_0/mean"].scale)) == pytest.approx(
        (float(np.max(hi)) - min(float(np.min(lo)), 0.0)) / 255, rel=0.02)
    unseen = [rng.normal(size=(4, 10)).astype(np.float32) * k for k in (1.0, 2.0)]
    report = odmlq.litert.verify(result.tflite, model, result.plan, result.scales, unseen,
                                 variables=variables, raise_on_failure=False)
    assert report.passed, str(report)
