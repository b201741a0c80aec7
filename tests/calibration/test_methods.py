"""Calibration methods as objects: dict round trips, defaults, errors."""

import json

import pytest

from odmlq import calibration as cal
from odmlq.calibration import (
    MSE, RMS, AbsMax, Entropy, FixedRange, MinMax, MovingAverageMinMax,
    Percentile,
)
from odmlq.errors import CalibrationError
from tests.calibration._common import (
    ALL_METHODS,
)


# ------------------------------------------------------------------- methods


@pytest.mark.parametrize("method", ALL_METHODS.values(), ids=ALL_METHODS.keys())
def test_method_dict_round_trip(method):
    d = method.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert cal.calibration_method_from_dict(d) == method
    assert cal.parse_calibration_method(d) == method
    assert cal.parse_calibration_method(method) is method
    assert method.needs_histogram == isinstance(method, (Percentile, MSE, Entropy))


def test_to_dict_shape():
    assert Percentile(99.99).to_dict() == {"method": "percentile", "percentile": 99.99}
    assert AbsMax().to_dict() == {"method": "absmax", "clip_ratio": 1.0}


@pytest.mark.parametrize(
    "name, expected",
    [("minmax", MinMax()), ("absmax", AbsMax()), ("mse", MSE()), ("percentile", Percentile()),
     ("moving_average_minmax", MovingAverageMinMax()), ("rms", RMS()), ("entropy", Entropy())],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_parse_bare_name_uses_defaults(name, expected):
    assert cal.parse_calibration_method(name) == expected


def test_unknown_method_name_lists_valid_names():
    with pytest.raises(CalibrationError, match=r"Unknown calibration method 'absmax,0.8'; choose one of \['absmax'"):
        cal.parse_calibration_method("absmax,0.8")


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Percentile(101), r"Percentile\(percentile=101\): percentile must be a number in \(50, 100\]"),
        (lambda: Percentile("99"), r"Percentile\(percentile='99'\)"),
        (lambda: AbsMax(clip_ratio=0), r"AbsMax\(clip_ratio=0\): clip_ratio must be a finite number > 0"),
        (lambda: AbsMax(clip_ratio=True), r"AbsMax\(clip_ratio=True\)"),
        (lambda: FixedRange(1, 0), r"FixedRange\(min=1.0, max=0.0\): min must be less than max"),
        (lambda: FixedRange(0, float("inf")), r"FixedRange\(max=inf\): max must be a finite number"),
        (lambda: MovingAverageMinMax(momentum=1.0), r"momentum must be a number in \[0, 1\)"),
        (lambda: RMS(multiplier=-2), r"RMS\(multiplier=-2\): multiplier must be a finite number > 0"),
    ],
    ids=["percentile_101", "percentile_str", "clip_ratio_0", "clip_ratio_bool", "fixed_reversed",
         "fixed_inf", "momentum_1", "rms_negative"],
)
def test_bad_field_values(make, match):
    with pytest.raises(CalibrationError, match=match):
        make()


def test_method_dict_errors():
    with pytest.raises(CalibrationError, match=r"'percentile' has no field\(s\) \['p'\]; its fields are \['percentile'\]"):
        cal.calibration_method_from_dict({"method": "percentile", "p": 99})
    with pytest.raises(CalibrationError, match=r"is incomplete: its fields are \['max', 'min'\]"):
        cal.parse_calibration_method("fixed_range")
    with pytest.raises(CalibrationError, match=r"needs a 'method' key"):
        cal.calibration_method_from_dict({"percentile": 99})
    with pytest.raises(CalibrationError, match=r"a method object .* got 3"):
        cal.parse_calibration_method(3)


def test_capped_leaves_values_at_the_cap_out_and_relative_mse_keeps_small_values_fine():
    """A norm's rsqrt factor: rows of zero variance give 1/sqrt(eps) = 1000, a
    few rows of small variance 20-40, most rows 1-3. Capped drops the 1000s;
    RelativeMSE then weighs each row's relative error (each row's share of
    the normalized output's error) and clips the few large factors."""
    import numpy as np

    from odmlq.calibration import Capped, Masked, RelativeMSE, compute_range, observe

    rng = np.random.default_rng(0)
    common = rng.uniform(1.0, 3.0, 2000)
    values = np.concatenate([common, [20.0, 30.0, 40.0], np.full(50, 1000.0)])
    minmax = Capped(707.1, MinMax())
    lo, hi = compute_range(minmax, observe(minmax, None, values), "int8", symmetric=False)
    assert float(hi) == 40.0  # the zero-variance rows are out, the small-variance ones set the range
    relative = Capped(707.1, RelativeMSE())
    rlo, rhi = compute_range(relative, observe(relative, None, values), "int8", symmetric=False)
    assert 3.0 < float(rhi) < 40.0  # clips the three large factors, keeps the common ones

    def relative_error(lo, hi):  # the normalized output's error: sum of ((r - q(r)) / r)^2
        data = values[values < 707.1]
        step = (float(hi) - min(float(lo), 0.0)) / 255
        q = np.clip(np.round(data / step) * step, 0, float(hi))
        return float(np.sum(((data - q) / data) ** 2))

    assert relative_error(rlo, rhi) < 0.8 * relative_error(lo, hi)
    for method in (relative, RelativeMSE()):
        assert cal.parse_calibration_method(method.to_dict()) == method
    # A batch whose values mostly reach the cap (a norm whose inputs' mean square
    # is about its eps) is observed whole: left out, its range was a zero's.
    for batch in (np.full(4, 1000.0), np.concatenate([np.full(30, 1000.0), np.full(10, 600.0)])):
        lo_all, hi_all = compute_range(relative, observe(relative, None, batch), "int8", symmetric=False)
        assert float(hi_all) > 707.1
    with pytest.raises(CalibrationError, match="Capped.cap"):
        Capped(-1.0)
    with pytest.raises(CalibrationError, match="plain method"):
        Capped(10.0, Masked())


def test_masked_leaves_the_sentinel_out_and_extends_the_range_below_the_data():
    """ln(2**8) + 1 below the data: exp of that is under one int8 softmax step."""
    import math

    import numpy as np

    from odmlq.calibration import Masked, compute_range, observe

    method = Masked(MinMax())
    stats = observe(method, None, np.array([-3.4e38, 1.0, 2.0, -1.0]))
    lo, hi = compute_range(method, stats, "int8", symmetric=False)
    assert float(hi) == 2.0
    np.testing.assert_allclose(float(lo), -1.0 - (8 * math.log(2.0) + 1.0), rtol=1e-6)
    bias = observe(method, None, np.array([0.0, -3.4e38, 0.0]))  # an additive mask: 0 or the sentinel
    assert tuple(float(v) for v in compute_range(method, bias, "int8", symmetric=False)) == (-64.0, 0.0)
    assert cal.parse_calibration_method(method.to_dict()) == method
    with pytest.raises(CalibrationError, match="Masked.sentinel"):
        Masked(MinMax(), sentinel=-1.0)
