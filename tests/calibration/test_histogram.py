"""Histogram methods: exact merges, percentiles, MSE and entropy thresholds."""


import numpy as np
import pytest

from odmlq.calibration import (
    MSE, Entropy, MinMax, MovingAverageMinMax,
    Percentile, compute_range, merge, observe, range_of,
)
from odmlq.errors import CalibrationError
from odmlq.qtypes import NF4_LEVELS
from tests.calibration._common import (
    bin_width, observe_all, quantization_mse,
)


# ----------------------------------------------------------------- histogram


@pytest.mark.parametrize("scale_b", [0.1, 1.0, 10.0, 1e6], ids=["b_smaller", "same", "b_10x", "b_1e6x"])
def test_histogram_merge_is_exact(rng, scale_b):
    a = rng.normal(size=5000)
    b = scale_b * rng.normal(size=3000)
    method = Percentile()
    sequential = observe_all(method, [a, b])
    merged = merge(method, observe(method, None, a), observe(method, None, b))
    at_once = observe(method, None, np.concatenate([a, b]))
    for stats in (merged, at_once):
        np.testing.assert_array_equal(stats.histogram, sequential.histogram)
        np.testing.assert_array_equal(stats.histogram_limit, sequential.histogram_limit)
    assert int(sequential.histogram.sum()) == 8000
    absmax = np.abs(np.concatenate([a, b])).max()
    # The limit is the smallest power of two strictly above every |x|.
    limit = float(sequential.histogram_limit)
    assert limit / 2 <= absmax < limit and np.log2(limit) == int(np.log2(limit))


def test_histogram_merge_after_all_zero_batch():
    method = Percentile()
    zeros = np.zeros(100)
    later = np.array([-3.0, 0.5, 7.0])
    sequential = observe_all(method, [zeros, later])
    at_once = observe(method, None, np.concatenate([zeros, later]))
    np.testing.assert_array_equal(sequential.histogram, at_once.histogram)
    np.testing.assert_array_equal(sequential.histogram_limit, 8.0)


@pytest.mark.parametrize("percentile", [99.0, 99.9, 99.99])
def test_percentile_within_one_bin_of_numpy(rng, percentile):
    x = rng.normal(size=200_000).astype(np.float32)
    stats = observe_all(Percentile(percentile), np.split(x, 4))
    width = bin_width(stats)
    # One bin, plus float32 rounding of the returned range.
    tolerance = width + 1e-6
    _, hi = compute_range(Percentile(percentile), stats, "int8", symmetric=True)
    np.testing.assert_allclose(hi, np.percentile(np.abs(x), percentile), rtol=0, atol=tolerance)
    lo, hi = compute_range(Percentile(percentile), stats, "int8", symmetric=False)
    np.testing.assert_allclose(lo, np.percentile(x, 100 - percentile), rtol=0, atol=tolerance)
    np.testing.assert_allclose(hi, np.percentile(x, percentile), rtol=0, atol=tolerance)


def test_percentile_100_is_the_data_range():
    x = np.array([-3.0, 1.0, 2.5])
    np.testing.assert_array_equal(range_of(Percentile(100), x, "int8", symmetric=False), [-3.0, 2.5])


@pytest.mark.parametrize("qtype, qmax", [("int8", 127), ("int4", 7)])
def test_mse_beats_absmax_and_matches_brute_force(rng, qtype, qmax):
    x = rng.normal(size=50_000).astype(np.float32)
    stats = observe(MSE(), None, x)
    _, hi = compute_range(MSE(), stats, qtype, symmetric=True)
    absmax = float(np.abs(x).max())
    width = bin_width(stats)
    candidates = np.append(width * np.arange(1, int(np.ceil(absmax / width))), absmax)
    brute_force = min(quantization_mse(x, t, qmax) for t in candidates[::2])
    chosen = quantization_mse(x, float(hi), qmax)
    assert chosen < quantization_mse(x, absmax, qmax)
    # The search models the data by its histogram; 1% covers that model's error.
    assert chosen <= 1.01 * brute_force, (chosen, brute_force)


def test_mse_asymmetric_matches_brute_force_on_skewed_data(rng):
    x = np.concatenate([rng.exponential(size=10_000), -0.1 * rng.exponential(size=10_000)])

    def error(lo, hi):
        step = (hi - lo) / 255
        return np.mean((x - (np.clip(np.round((x - lo) / step), 0, 255) * step + lo)) ** 2)

    lo, hi = range_of(MSE(), x, "int8", symmetric=False)
    assert x.min() <= lo < 0 < hi < x.max()
    chosen = error(float(lo), float(hi))
    grid = [(a, b) for a in np.linspace(x.min(), 0, 25)[:-1] for b in np.linspace(0, x.max(), 25)[1:]]
    brute_force = min(error(a, b) for a, b in grid)
    # Coordinate descent over bin edges is at least as good as a coarse 2-D
    # grid, up to the error of modelling the data by its histogram (1%).
    assert chosen <= 1.01 * brute_force, (chosen, brute_force)
    assert chosen < error(x.min(), x.max())
    lo, _ = range_of(MSE(), np.abs(x), "int8", symmetric=False)
    np.testing.assert_array_equal(lo, 0.0)


def test_mse_nf4_beats_absmax(rng):
    x = rng.normal(size=20_000)

    def error(threshold):
        levels = NF4_LEVELS.astype(np.float64) * threshold
        return np.mean((x - levels[np.abs(x[:, None] - levels).argmin(1)]) ** 2)

    _, hi = range_of(MSE(), x, "nf4", symmetric=True)
    assert error(float(hi)) < 0.9 * error(np.abs(x).max())


@pytest.mark.parametrize("distribution", ["laplace", "student_t"])
def test_mse_and_entropy_clip_outliers_of_heavy_tails(rng, distribution):
    # MSE weighs an outlier by its squared distance, so it clips three outliers
    # at ~4x the bulk's abs max only when the bulk is large: a million values.
    size = 1_000_000
    bulk = rng.laplace(size=size) if distribution == "laplace" else rng.standard_t(3, size=size)
    outliers = np.abs(bulk).max() * np.array([4.0, -3.5, 4.5])
    x = np.concatenate([bulk, outliers]).astype(np.float32)
    absmax, extent = float(np.abs(x).max()), float(x.max() - x.min())
    for method in (MSE(), Entropy()):
        stats = observe(method, None, x)
        _, hi = compute_range(method, stats, "int8", symmetric=True)
        assert 0 < hi < absmax / 2, (method, hi, absmax)
        lo, hi = compute_range(method, stats, "int8", symmetric=False)
        assert lo < 0 < hi and hi - lo < extent / 2, (method, lo, hi, extent)


def test_entropy_threshold_on_gaussian_is_sensible(rng):
    x = rng.normal(size=200_000)
    absmax = np.abs(x).max()
    for qtype, low in [("int8", 3.5), ("int4", 2.0)]:
        _, hi = range_of(Entropy(), x, qtype, symmetric=True)
        assert low < hi <= absmax, (qtype, hi)
    # ReLU outputs: the spike of exact zeros must not drag the threshold down.
    lo, hi = range_of(Entropy(), np.maximum(x, 0), "int8", symmetric=False)
    assert lo == 0 and 3.5 < hi <= absmax, hi
    # int16 has more levels than the histogram has bins: nothing to clip.
    np.testing.assert_array_equal(range_of(Entropy(), x, "int16", symmetric=True)[1], np.float32(absmax))


def test_histogram_method_errors(rng):
    x = rng.normal(size=(4, 3))
    with pytest.raises(CalibrationError, match=r"support per-tensor activations only .* use MinMax\(\) or AbsMax\(\)"):
        observe(Percentile(), None, x, keep_axes=(1,))
    with pytest.raises(CalibrationError, match=r"Entropy needs an integer qtype, got 'fp8_e4m3'"):
        range_of(Entropy(), x, "fp8_e4m3", symmetric=True)
    with pytest.raises(CalibrationError, match=r"MSE with an asymmetric range needs an integer qtype, got 'nf4'"):
        range_of(MSE(), x, "nf4", symmetric=False)
    with pytest.raises(CalibrationError, match=r"MSE needs a histogram, but these statistics"):
        compute_range(MSE(), observe(MinMax(), None, x), "int8", symmetric=True)
    with pytest.raises(CalibrationError, match=r"MovingAverageMinMax needs moving averages"):
        compute_range(MovingAverageMinMax(), observe(MinMax(), None, x), "int8", symmetric=True)
    with pytest.raises(CalibrationError, match=r"MinMax\(\) needs statistics; observe at least one batch"):
        compute_range(MinMax(), None, "int8", symmetric=True)


def test_batch_errors():
    x = np.array([1.0, np.nan, np.inf, 2.0])
    with pytest.raises(CalibrationError, match=r"The batch has 2 non-finite values \(NaN or Inf\) out of 4"):
        observe(MinMax(), None, x)
    with pytest.raises(CalibrationError, match=r"The batch is empty \(shape \(0, 3\)\)"):
        observe(MinMax(), None, np.zeros((0, 3)))
    with pytest.raises(CalibrationError, match=r"keep_axes=\(2,\) does not fit a tensor of shape \(2, 2\)"):
        observe(MinMax(), None, np.ones((2, 2)), keep_axes=(2,))
    with pytest.raises(CalibrationError, match=r"keep_axes=\(0, -2\) does not fit .* distinct"):
        observe(MinMax(), None, np.ones((2, 2)), keep_axes=(0, -2))
    with pytest.raises(CalibrationError, match=r"keep_axes must be a sequence of ints, got \(0.5,\)"):
        observe(MinMax(), None, np.ones(2), keep_axes=(0.5,))
    with pytest.raises(CalibrationError, match=r"needs real numbers, got dtype complex128"):
        observe(MinMax(), None, np.ones(2, complex))


def test_mismatched_statistics_errors():
    per_channel = observe(MinMax(), None, np.ones((2, 3)), keep_axes=(1,))
    with pytest.raises(CalibrationError, match=r"kept along axes \(1,\) .* and \(\) .* cannot be combined"):
        observe(MinMax(), per_channel, np.ones((2, 3)))
    with pytest.raises(CalibrationError, match=r"not observed with Percentile\(percentile=99.99\)"):
        observe(Percentile(), observe(MinMax(), None, np.ones(3)), np.ones(3))
    with pytest.raises(CalibrationError, match=r"not observed with MovingAverageMinMax"):
        merge(MovingAverageMinMax(), per_channel, per_channel)
