"""Shared helpers of the calibration tests."""

import functools

import hypothesis
import numpy as np

from odmlq.calibration import (
    MSE, RMS, AbsMax, Entropy, FixedRange, MinMax, MovingAverageMinMax, Percentile, Statistics, observe,
)
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
