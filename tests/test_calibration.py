"""Tests of odmlq.calibration: statistics against numpy, exact merges, ranges, files."""

import functools
import json
import os
import re

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from odmlq import calibration as cal
from odmlq.calibration import (
    MSE, RMS, AbsMax, Calibration, Entropy, FixedRange, MinMax, MovingAverageMinMax,
    Percentile, Statistics, compute_range, merge, observe, range_of,
)
from odmlq.errors import CalibrationError
from odmlq.qtypes import NF4_LEVELS

settings = functools.partial(
    hypothesis.settings, max_examples=40, deadline=None, derandomize=True, database=None
)

ALL_METHODS = {
    "absmax": AbsMax(clip_ratio=0.8),
    "minmax": MinMax(),
    "moving_average": MovingAverageMinMax(momentum=0.5),
    "rms": RMS(multiplier=3.0),
    "fixed_range": FixedRange(-1.0, 6.0),
    "percentile": Percentile(99.9),
    "mse": MSE(),
    "entropy": Entropy(),
}
FIELDS = [
    "count", "min", "max", "sum", "sum_of_squares", "batches",
    "moving_min", "moving_max", "histogram", "histogram_limit",
]


def assert_statistics_equal(a: Statistics, b: Statistics) -> None:
    assert a.keep_axes == b.keep_axes
    for field in FIELDS:
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None), field
        if x is not None:
            np.testing.assert_array_equal(x, y, err_msg=field)


def observe_all(method, batches, **kwargs) -> Statistics:
    stats = None
    for batch in batches:
        stats = observe(method, stats, batch, **kwargs)
    return stats


def bin_width(stats: Statistics) -> float:
    return 2 * float(stats.histogram_limit) / stats.histogram.shape[0]


def quantization_mse(x: np.ndarray, threshold: float, qmax: int) -> float:
    """Symmetric narrow-range fake quantization error, round half to even."""
    step = threshold / qmax
    return float(np.mean((x - np.clip(np.round(x / step), -qmax, qmax) * step) ** 2))


@pytest.fixture
def rng():
    return np.random.default_rng(0)


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


# ---------------------------------------------------------------- statistics


def test_scalar_statistics_match_numpy_over_batches(rng):
    batches = [rng.normal(loc=i, size=(7, 5)).astype(np.float32) for i in range(4)]
    everything = np.concatenate([b.ravel() for b in batches]).astype(np.float64)
    stats = observe_all(MinMax(), batches)
    # min and max are exact: no arithmetic happens on them.
    np.testing.assert_array_equal(stats.min, everything.min())
    np.testing.assert_array_equal(stats.max, everything.max())
    assert int(stats.count) == everything.size and int(stats.batches) == 4
    # Sums are float64 in another order than numpy's pairwise sum: rtol 1e-12.
    np.testing.assert_allclose(stats.sum, everything.sum(), rtol=1e-12)
    np.testing.assert_allclose(stats.sum_of_squares, np.square(everything).sum(), rtol=1e-12)

    lo, hi = compute_range(MinMax(), stats, "int8", symmetric=False)
    np.testing.assert_array_equal([lo, hi], np.float32([everything.min(), everything.max()]))
    absmax = np.abs(everything).max()
    lo, hi = compute_range(AbsMax(), stats, "int8", symmetric=False)
    np.testing.assert_array_equal([lo, hi], np.float32([-absmax, absmax]))
    _, hi = compute_range(AbsMax(clip_ratio=0.5), stats, "int8", symmetric=True)
    np.testing.assert_array_equal(hi, np.float32(0.5 * absmax))
    # RMS: float32 output of a float64 formula, rtol 1e-6.
    _, hi = compute_range(RMS(multiplier=1.0), stats, "int8", symmetric=True)
    np.testing.assert_allclose(hi, np.sqrt(np.mean(everything**2)), rtol=1e-6)
    lo, hi = compute_range(RMS(multiplier=0.5), stats, "int8", symmetric=False)
    mean, std = everything.mean(), everything.std()
    np.testing.assert_allclose([lo, hi], [min(mean - 0.5 * std, 0), mean + 0.5 * std], rtol=1e-6)


def test_rms_range_never_wider_than_data():
    x = np.linspace(-1.0, 1.0, 101)
    lo, hi = range_of(RMS(multiplier=4.0), x, "int8", symmetric=False)
    np.testing.assert_array_equal([lo, hi], [-1.0, 1.0])


@pytest.mark.parametrize(
    "keep_axes, reduce_axes",
    [((0,), (1, 2)), ((-1,), (0, 1)), ((2, 0), (1,)), ((0, 1, 2), ())],
    ids=["first", "last_negative", "two_axes_reordered", "all_axes"],
)
def test_per_channel_min_max_match_numpy(rng, keep_axes, reduce_axes):
    batches = [rng.normal(size=(3, 4, 5)) * np.arange(1, 6) for _ in range(3)]
    everything = np.stack(batches, axis=-1)  # the batch axis is always reduced
    stats = observe_all(MinMax(), batches, keep_axes=keep_axes)
    kept = [a % 3 for a in keep_axes]
    expected_min = np.moveaxis(everything.min(axis=reduce_axes + (3,), keepdims=True), kept, range(len(kept)))
    expected_max = np.moveaxis(everything.max(axis=reduce_axes + (3,), keepdims=True), kept, range(len(kept)))
    shape = tuple(everything.shape[a] for a in kept)
    np.testing.assert_array_equal(stats.min, expected_min.reshape(shape))
    np.testing.assert_array_equal(stats.max, expected_max.reshape(shape))
    lo, hi = compute_range(MinMax(), stats, "int8", symmetric=True)
    assert lo.shape == hi.shape == shape and lo.dtype == np.float32
    np.testing.assert_array_equal(hi, np.maximum(np.abs(stats.min), np.abs(stats.max)).astype(np.float32))
    np.testing.assert_array_equal(lo, -hi)


def test_ranges_always_contain_zero():
    x = np.array([2.0, 3.0, 5.0])
    for name, method in ALL_METHODS.items():
        lo, hi = range_of(method, x, "int8", symmetric=False)
        assert lo <= 0 <= hi, name
    lo, hi = range_of(MinMax(), -x, "int8", symmetric=False)
    np.testing.assert_array_equal([lo, hi], [-5.0, 0.0])


def test_fixed_range_ignores_data(rng):
    method = FixedRange(min=-1.0, max=6.0)
    for x in [rng.normal(size=100), 1000 * rng.normal(size=100)]:
        np.testing.assert_array_equal(range_of(method, x, "int8", symmetric=False), [-1.0, 6.0])
        np.testing.assert_array_equal(range_of(method, x, "int8", symmetric=True), [-6.0, 6.0])
    np.testing.assert_array_equal(compute_range(method, None, "int8", symmetric=False), [-1.0, 6.0])
    lo, hi = range_of(method, rng.normal(size=(4, 3)), "int8", symmetric=False, keep_axes=(1,))
    np.testing.assert_array_equal(lo, np.full(3, -1.0, np.float32))
    assert FixedRange(1, 2).to_dict() == {"method": "fixed_range", "min": 1.0, "max": 2.0}
    np.testing.assert_array_equal(compute_range(FixedRange(1.0, 2.0), None, "int8", symmetric=False), [0.0, 2.0])


def test_moving_average_matches_hand_loop(rng):
    momentum = 0.8
    batches = [rng.normal(scale=1 + i, size=(16, 3)) for i in range(6)]
    ema_min, ema_max = batches[0].min(0), batches[0].max(0)
    for b in batches[1:]:
        ema_min = momentum * ema_min + (1 - momentum) * b.min(0)
        ema_max = momentum * ema_max + (1 - momentum) * b.max(0)
    method = MovingAverageMinMax(momentum=momentum)
    stats = observe_all(method, batches, keep_axes=(1,))
    # The same float64 formula; rtol 1e-12 leaves room for reassociation only.
    np.testing.assert_allclose(stats.moving_min, ema_min, rtol=1e-12)
    np.testing.assert_allclose(stats.moving_max, ema_max, rtol=1e-12)
    lo, hi = compute_range(method, stats, "int8", symmetric=False)
    np.testing.assert_allclose(lo, np.minimum(ema_min, 0), rtol=1e-6)
    np.testing.assert_allclose(hi, np.maximum(ema_max, 0), rtol=1e-6)


def test_moving_average_merge_is_count_weighted():
    method = MovingAverageMinMax()
    a = observe(method, None, np.array([-1.0, 1.0]))
    b = observe(method, None, np.array([-4.0, 0.0, 4.0, 2.0, 1.0, 0.0]))
    merged = merge(method, a, b)
    np.testing.assert_allclose(merged.moving_min, (2 * -1.0 + 6 * -4.0) / 8, rtol=1e-15)
    np.testing.assert_allclose(merged.moving_max, (2 * 1.0 + 6 * 4.0) / 8, rtol=1e-15)


def test_jax_arrays_are_observed():
    x = jnp.asarray([[-1.5, 2.0], [0.25, 3.0]], jnp.bfloat16)
    stats = observe(MinMax(), None, x, keep_axes=(1,))
    np.testing.assert_array_equal(stats.min, [-1.5, 2.0])


def test_statistics_is_a_pytree():
    stats = observe(Percentile(), None, np.arange(10.0))
    leaves, treedef = jax.tree_util.tree_flatten(stats)
    assert len(leaves) == 8  # the two moving-average fields are None
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert_statistics_equal(rebuilt, stats)
    doubled = jax.tree_util.tree_map(lambda v: v * 2, stats)
    np.testing.assert_array_equal(doubled.count, 20)


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


# ------------------------------------------------------ merge properties


def batches_strategy():
    # Values k * 2**e with |k| <= 1000 and |e| <= 6 keep every float64 sum of a
    # few dozen values and of their squares exact, so merges compare exactly.
    value = st.builds(lambda k, e: float(k) * 2.0**e, st.integers(-1000, 1000), st.integers(-6, 6))
    return st.lists(st.lists(value, min_size=1, max_size=12), min_size=3, max_size=3)


@pytest.mark.parametrize("method", [MinMax(), Percentile()], ids=["minmax", "histogram"])
@settings()
@hypothesis.given(batches=batches_strategy())
def test_merge_is_associative_and_commutative(method, batches):
    a, b, c = (observe(method, None, np.array(batch)) for batch in batches)
    assert_statistics_equal(merge(method, a, b), merge(method, b, a))
    assert_statistics_equal(merge(method, merge(method, a, b), c), merge(method, a, merge(method, b, c)))
    assert_statistics_equal(merge(method, merge(method, a, b), c), observe_all(method, [np.array(x) for x in batches]))


# --------------------------------------------------------------- Calibration


def small_calibration(rng) -> Calibration:
    calibration = Calibration()
    for i in range(3):
        calibration.observe("encoder/dense/out", MinMax(), rng.normal(size=(8, 4)), batch_index=i)
        calibration.observe("encoder/conv/out", Percentile(99.9), rng.normal(size=(8, 4)))
        calibration.observe("head/kernel", AbsMax(0.9), rng.normal(size=(8, 4)), keep_axes=(-1,))
        calibration.observe("head/out", MovingAverageMinMax(), rng.normal(size=(8, 4)))
    return calibration


def assert_calibrations_equal(a: Calibration, b: Calibration) -> None:
    assert a.edges == b.edges
    for edge in a:
        assert a[edge][0] == b[edge][0]
        assert_statistics_equal(a[edge][1], b[edge][1])


def test_calibration_mapping(rng):
    calibration = small_calibration(rng)
    assert len(calibration) == 4 and "head/out" in calibration and "nope" not in calibration
    assert calibration.edges == ("encoder/dense/out", "encoder/conv/out", "head/kernel", "head/out")
    method, stats = calibration["head/kernel"]
    assert method == AbsMax(0.9) and stats.keep_axes == (-1,)
    lo, hi = calibration.range("head/kernel", "int8", symmetric=True)
    assert lo.shape == (4,)
    np.testing.assert_array_equal(hi, compute_range(method, stats, "int8", symmetric=True)[1])
    assert "Calibration(4 edges" in repr(calibration)


def test_calibration_errors(rng):
    calibration = small_calibration(rng)
    with pytest.raises(CalibrationError, match=r"edge 'encoder/dense/out', batch 7: The batch has 1 non-finite"):
        calibration.observe("encoder/dense/out", MinMax(), np.array([np.nan, 1.0]), batch_index=7)
    with pytest.raises(CalibrationError, match=r"edge 'head/out': observed with MovingAverageMinMax.* before, now MinMax"):
        calibration.observe("head/out", MinMax(), np.ones(3))
    with pytest.raises(CalibrationError, match=r"No calibration for edge 'missing'"):
        calibration.range("missing", "int8", symmetric=True)
    with pytest.raises(KeyError, match=r"No calibration for edge 'missing'"):
        calibration["missing"]
    other = Calibration()
    other.observe("encoder/dense/out", MinMax(), np.ones(3))
    with pytest.raises(CalibrationError, match=r"different edges: edge 'encoder/conv/out' is in only one"):
        calibration.merge(other)
    changed = Calibration({e: (m, s) for e, (m, s) in calibration.items()})
    changed._entries["head/out"] = (MinMax(), changed["head/out"][1])
    with pytest.raises(CalibrationError, match=r"Cannot merge edge 'head/out': calibrated with MovingAverageMinMax"):
        calibration.merge(changed)


def test_calibration_merge_equals_one_stream(rng):
    batches = [rng.normal(scale=s, size=(8, 4)) for s in (1.0, 10.0, 0.1, 3.0)]
    whole, first, second = Calibration(), Calibration(), Calibration()
    for i, batch in enumerate(batches):
        whole.observe("x", Percentile(), batch)
        (first if i < 2 else second).observe("x", Percentile(), batch)
    merged = first.merge(second)
    np.testing.assert_array_equal(merged["x"][1].histogram, whole["x"][1].histogram)
    np.testing.assert_array_equal(merged.range("x", "int8", symmetric=True), whole.range("x", "int8", symmetric=True))


def test_save_load_round_trip_then_merge(rng, tmp_path):
    calibration = small_calibration(rng)
    path = tmp_path / "calibration.npz"
    calibration.save(path)
    loaded = Calibration.load(path)
    assert_calibrations_equal(loaded, calibration)
    assert sorted(os.listdir(tmp_path)) == ["calibration.npz"]  # no temp file left
    merged = loaded.merge(small_calibration(rng))
    assert int(merged["encoder/dense/out"][1].count) == 2 * int(calibration["encoder/dense/out"][1].count)
    with np.load(path, allow_pickle=False) as data:  # readable without pickle
        assert "metadata" in data.files


def test_json_round_trip(rng):
    calibration = small_calibration(rng)
    text = calibration.to_json()
    assert json.loads(text)["format"] == "odmlq.calibration"
    assert_calibrations_equal(Calibration.from_json(text), calibration)


def test_save_is_atomic(rng, tmp_path, monkeypatch):
    path = tmp_path / "calibration.npz"
    small_calibration(rng).save(path)
    before = path.read_bytes()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", fail)
    monkeypatch.setattr(np, "savez_compressed", fail)
    with pytest.raises(OSError, match="disk full"):
        small_calibration(np.random.default_rng(1)).save(path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["calibration.npz"]


def test_load_rejects_foreign_and_corrupt_files(rng, tmp_path):
    text = tmp_path / "notes.npz"
    text.write_text("not a zip")
    with pytest.raises(CalibrationError, match=re.escape(repr(str(text)))):
        Calibration.load(text)
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, weights=np.ones(3))
    with pytest.raises(CalibrationError, match=r"foreign.npz.* has no calibration metadata"):
        Calibration.load(foreign)
    single = tmp_path / "single.npy"
    np.save(single, np.ones(3))
    with pytest.raises(CalibrationError, match=r"single.npy.* is a single .npy array"):
        Calibration.load(single)
    newer = tmp_path / "newer.npz"
    metadata = json.dumps({"format": "odmlq.calibration", "version": 99, "edges": []}).encode()
    np.savez(newer, metadata=np.frombuffer(metadata, np.uint8))
    with pytest.raises(CalibrationError, match=r"newer.npz.* version 99; this odmlq reads version 1"):
        Calibration.load(newer)
    truncated = tmp_path / "truncated.npz"
    small_calibration(rng).save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:200])
    with pytest.raises(CalibrationError, match=r"truncated.npz.* is not a readable odmlq calibration file"):
        Calibration.load(truncated)
    with pytest.raises(FileNotFoundError):
        Calibration.load(tmp_path / "missing.npz")


def test_from_json_rejects_bad_statistics(rng):
    data = json.loads(small_calibration(rng).to_json())
    data["edges"][0]["statistics"]["min"] = [1.0, 2.0]
    with pytest.raises(CalibrationError, match=r"edge 'encoder/dense/out': statistics arrays have inconsistent shapes"):
        Calibration.from_json(json.dumps(data))
    del data["edges"][1]["statistics"]["count"]
    data["edges"][0]["statistics"]["min"] = 1.0
    with pytest.raises(CalibrationError, match=r"edge 'encoder/conv/out': statistics field 'count' is missing"):
        Calibration.from_json(json.dumps(data))
    with pytest.raises(CalibrationError, match=r"does not parse"):
        Calibration.from_json("{")
    data = json.loads(small_calibration(rng).to_json())
    data["edges"][1]["statistics"]["histogram_limit"] = 3.0
    with pytest.raises(CalibrationError, match=r"edge 'encoder/conv/out': the histogram is inconsistent"):
        Calibration.from_json(json.dumps(data))
