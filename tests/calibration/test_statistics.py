"""Streaming statistics against numpy over batches, and exact merges."""


import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from odmlq.calibration import (
    RMS, AbsMax, FixedRange, MinMax, MovingAverageMinMax,
    Percentile, compute_range, merge, observe, range_of,
)
from tests.calibration._common import (
    ALL_METHODS, assert_statistics_equal, observe_all, settings,
)


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
