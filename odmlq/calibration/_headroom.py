"""The headroom of `MinMax(headroom=True)`: how far past the extreme seen a
range's end goes, from the tail of the data (internal; see `MinMax`)."""

from __future__ import annotations

import numpy as np

__all__ = ["EXTREMES", "HEADROOM_LIMIT", "beyond_extreme"]

# How many of the most extreme values `MinMax(headroom=True)` keeps per side.
EXTREMES = 8
# The most headroom on one side, as a fraction of the range seen: the tail is
# extrapolated from a few values, so not far. (On samples of 160-2560 values
# the limit keeps all but 0.1 dB of the gain; with few steps to lose, int16's
# MSE optimum is 5x the range for a squared Gaussian, which LiteRT's int16
# RSQRT table then covered 86 LSB off.)
HEADROOM_LIMIT = 0.25


def beyond_extreme(excess: np.ndarray, width: np.ndarray, count: np.ndarray, levels: float) -> np.ndarray:
    """The headroom beyond one end (see `MinMax`), per channel. `excess`: the
    most extreme values' distances beyond the least extreme kept, last axis."""
    sigma = np.sum(excess, axis=-1) / np.maximum(excess.shape[-1] - 1, 1)
    n = np.asarray(count, np.float64)
    # d minimizes (width + d)^2 / (12 levels^2) + 2 sigma^2 exp(-d / sigma) / n:
    # n (width + d) / (12 levels^2 sigma) = exp(-d / sigma), one root, found by bisection.
    with np.errstate(divide="ignore", invalid="ignore"):
        def slope(d):
            return n * (width + d) / (12 * levels ** 2 * sigma) - np.exp(-d / sigma)

        top = np.where(sigma > 0, sigma * np.log(np.maximum(12 * levels ** 2 * sigma / (n * width), 1.0)), 0.0)
        low, high = np.zeros_like(top), top
        for _ in range(40):
            middle = (low + high) / 2
            below = slope(middle) < 0
            low, high = np.where(below, middle, low), np.where(below, high, middle)
        found = np.where((sigma > 0) & (width > 0) & (slope(np.zeros_like(top)) < 0), low, 0.0)
    return np.minimum(found, HEADROOM_LIMIT * width)
