"""MinMax(headroom=True): ranges for data the calibration did not see.

The range's end moves past the extreme seen by the amount that minimizes
rounding error plus expected clipping error; tests compare those errors on
fresh data (mean squared error of int8 fake-quantization), so they check the
claim itself, not a formula.
"""

import numpy as np
import pytest

from odmlq.calibration import Calibration, MinMax, compute_range, merge, observe, parse_calibration_method
from odmlq.errors import CalibrationError
from odmlq.qarray import compute_scale, fake_quant

HEADROOM = MinMax(headroom=True)


def _int8_mse(x: np.ndarray, lo, hi) -> float:
    scale, zero_point = compute_scale(np.float32(lo), np.float32(hi), "int8", symmetric=False)
    y = np.asarray(fake_quant(x.astype(np.float32), "int8", scale=scale, zero_point=zero_point))
    return float(np.mean((y - x) ** 2))


def _range(method, x, keep_axes=()):
    return compute_range(method, observe(method, None, x, keep_axes=keep_axes), "int8", symmetric=False)


def _mse_change_db(draw, rows: int, seeds: int = 20) -> float:
    """Mean over `seeds` draws of the int8 error on 100,000 fresh values with
    headroom, against plain MinMax, in dB (negative: headroom is better)."""
    changes = []
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        seen, fresh = draw(rng, rows), draw(rng, 100_000)
        changes.append(10 * np.log10(_int8_mse(fresh, *_range(HEADROOM, seen)) / _int8_mse(fresh, *_range(MinMax(), seen))))
    return float(np.mean(changes))


OFFSETS = np.linspace(-1, 1.5, 10)


@pytest.mark.parametrize("name,draw,rows,bound_db", [
    # Logits-like: 10 channels with their own offsets (measured -1.97 / -0.35 dB).
    ("logits", lambda rng, n: rng.standard_normal((n, 10)) * 0.25 + OFFSETS, 64, -1.0),
    ("logits", lambda rng, n: rng.standard_normal((n, 10)) * 0.25 + OFFSETS, 256, -0.1),
    # A ReLU's outputs: zeros below, a Gaussian tail above (measured -8.8 dB).
    ("relu", lambda rng, n: np.maximum(rng.standard_normal(n * 10), 0), 64, -4.0),
    # Heavy tails gain the most (measured -7.5 dB).
    ("laplace", lambda rng, n: rng.laplace(size=n * 10), 64, -4.0),
], ids=["logits-640", "logits-2560", "relu-640", "laplace-640"])
def test_few_values_get_headroom_that_lowers_the_error_on_unseen_data(name, draw, rows, bound_db):
    """A few hundred values' extremes are passed by new data; clipping those
    costs more than the wider grid's rounding."""
    assert _mse_change_db(draw, rows) <= bound_db


@pytest.mark.parametrize("rows,bound_db", [(16, 1.0), (2048, 0.05)], ids=["160", "20480"])
def test_uniform_data_loses_little(rows, bound_db):
    """A bounded tail with no ties: what headroom costs where none was needed
    (measured +0.4 to +0.7 dB at 160 values over 30 and 20 draws, 0.00 at 20,480)."""
    assert _mse_change_db(lambda rng, n: rng.uniform(-1, 1, n * 10), rows) <= bound_db


def test_headroom_is_at_most_a_quarter_of_the_range():
    x = np.random.default_rng(4).standard_normal(50) ** 2  # a heavy tail, few values
    (_, hi), (_, plain_hi) = _range(HEADROOM, x), _range(MinMax(), x)
    np.testing.assert_allclose(hi, plain_hi * 1.25, rtol=1e-6)


def test_bounded_data_gets_none():
    """Pixels clipped to [0, 1] and ReLU zeros: ties at both ends, so no tail."""
    rng = np.random.default_rng(0)
    x = np.clip(rng.normal(0.5, 0.4, 5000), 0.0, 1.0)
    np.testing.assert_array_equal(_range(HEADROOM, x), _range(MinMax(), x))


def test_many_values_get_almost_none():
    x = np.random.default_rng(1).standard_normal(2_000_000)
    (lo, hi), (plain_lo, plain_hi) = _range(HEADROOM, x), _range(MinMax(), x)
    assert 0 <= (hi - plain_hi) + (plain_lo - lo) <= 0.01 * (plain_hi - plain_lo)


def test_streamed_batches_and_merges_keep_the_same_extremes():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((300, 4))
    whole = observe(HEADROOM, None, x, keep_axes=(1,))
    streamed = observe(HEADROOM, observe(HEADROOM, None, x[:7], keep_axes=(1,)), x[7:], keep_axes=(1,))
    merged = merge(HEADROOM, observe(HEADROOM, None, x[:150], keep_axes=(1,)),
                   observe(HEADROOM, None, x[150:], keep_axes=(1,)))
    for stats in (streamed, merged):
        np.testing.assert_array_equal(stats.top, whole.top)
        np.testing.assert_array_equal(stats.bottom, whole.bottom)
    assert whole.top.shape == (4, 8)
    np.testing.assert_array_equal(whole.top[:, 0], x.max(0))
    np.testing.assert_array_equal(whole.bottom[:, 0], x.min(0))


def test_a_saved_calibration_keeps_the_extremes(tmp_path):
    calibration = Calibration()
    calibration.observe("logits", HEADROOM, np.random.default_rng(3).standard_normal((50, 10)))
    calibration.save(tmp_path / "c.npz")
    for again in (Calibration.load(tmp_path / "c.npz"), Calibration.from_json(calibration.to_json())):
        np.testing.assert_array_equal(again.range("logits", "int8", symmetric=False),
                                      calibration.range("logits", "int8", symmetric=False))
        assert again["logits"][0] == HEADROOM


def test_headroom_parses_and_prints():
    assert parse_calibration_method({"method": "minmax", "headroom": True}) == HEADROOM
    assert parse_calibration_method(HEADROOM.to_dict()) == HEADROOM
    assert MinMax().to_dict() == {"method": "minmax"}
    assert repr(HEADROOM) == "MinMax(headroom=True)" and repr(MinMax()) == "MinMax()"


def test_headroom_errors():
    with pytest.raises(CalibrationError, match=r"MinMax\(headroom='yes'\): headroom must be True or False"):
        MinMax(headroom="yes")
    with pytest.raises(CalibrationError, match=r"needs the most extreme values.*observe with MinMax\(headroom=True\)"):
        compute_range(HEADROOM, observe(MinMax(), None, np.ones(3)), "int8", symmetric=False)
