"""A mergeable signed histogram, and the clipping searches that read it.

The histogram has `HISTOGRAM_BINS` bins of equal width over [-R, R), where the
limit R is always a power of two: the smallest one strictly above every |x|
seen so far (but at least `MIN_LIMIT`). A value x lands in bin
``B/2 + floor(x / w)`` with ``w = 2R/B``; since w is a power of two the
division is exact, so the bin of a value never depends on rounding. Growing R
to ``g * R`` (g a power of two) sends bin i to ``(B/2 * (g - 1) + i) // g``,
which is exactly where its values would have landed had R been ``g * R`` from
the start. Two histograms are therefore merged exactly by growing the one with
the smaller limit and adding counts; the result does not depend on batch order.

Everything here is private numpy; `odmlq.calibration` is the public face.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from odmlq.errors import CalibrationError
from odmlq.qtypes import NF4_LEVELS, QType

HISTOGRAM_BINS = 4096
# float32's smallest normal number: below it every value is "zero" to us, and a
# floor on R keeps an all-zero first batch from asking for R = 0.
MIN_LIMIT = 2.0**-126
# Coarse-to-fine searches evaluate about this many candidates, then refine
# around the best; the costs below are smooth enough in the threshold for that.
_COARSE_CANDIDATES = 128
# Bound on the (candidates x bins) matrices of the MSE search, in elements.
_CHUNK_ELEMENTS = 1 << 19


def limit_for(absmax: float) -> float:
    """The smallest power of two strictly greater than `absmax` (>= MIN_LIMIT)."""
    if not absmax < 2.0**1023:
        raise CalibrationError(
            f"Values up to {absmax!r} are too large to histogram; float64 cannot "
            "hold the next power of two."
        )
    if absmax < MIN_LIMIT:
        return MIN_LIMIT
    _, exponent = np.frexp(absmax)  # absmax = m * 2**e with m in [0.5, 1)
    return float(np.ldexp(1.0, int(exponent)))


def build(x: np.ndarray, limit: float) -> np.ndarray:
    """Counts of the float64 values `x` (all |x| < limit) in bins over [-limit, limit)."""
    width = 2.0 * limit / HISTOGRAM_BINS
    index = np.floor(x / width).astype(np.int64) + HISTOGRAM_BINS // 2
    return np.bincount(index.ravel(), minlength=HISTOGRAM_BINS).astype(np.int64)


def grow(counts: np.ndarray, limit: float, new_limit: float) -> np.ndarray:
    """Re-bins `counts` over [-new_limit, new_limit), new_limit = limit * 2**k."""
    if new_limit == limit:
        return counts
    half = counts.shape[0] // 2
    factor = int(round(new_limit / limit))
    source = np.arange(counts.shape[0], dtype=np.int64)
    if factor >= half:
        # Everything lands in the two central bins; also avoids int64 overflow
        # of (factor - 1) * half for very large factors.
        target = np.where(source < half, half - 1, half)
    else:
        target = ((factor - 1) * half + source) // factor
    grown = np.zeros_like(counts)
    np.add.at(grown, target, counts)
    return grown


def merge(
    counts_a: np.ndarray, limit_a: float, counts_b: np.ndarray, limit_b: float
) -> tuple[np.ndarray, float]:
    """Exact sum of two histograms, over the larger of their limits."""
    limit = max(limit_a, limit_b)
    return grow(counts_a, limit_a, limit) + grow(counts_b, limit_b, limit), limit


def fold(counts: np.ndarray) -> np.ndarray:
    """Histogram of |x| over [0, limit): bin k holds |x| in [k w, (k + 1) w]."""
    half = counts.shape[0] // 2
    return counts[half:] + counts[:half][::-1]


def quantile(
    counts: np.ndarray, start: float, width: float, q: float, lowest: float, highest: float
) -> float:
    """The q-quantile (0..1) as numpy's default 'linear' method defines it.

    Each order statistic is estimated within its bin (values spread evenly,
    the first and last exactly `lowest` and `highest`), so the result is
    within one bin width of `np.quantile` of the values themselves.
    """
    cumulative = np.cumsum(counts)
    total = int(cumulative[-1])

    def order_statistic(rank: int) -> float:
        if rank in (0, total - 1):
            return lowest if rank == 0 else highest
        i = int(np.searchsorted(cumulative, rank, side="right"))
        before = int(cumulative[i - 1]) if i > 0 else 0
        estimate = start + width * (i + (rank - before + 0.5) / int(counts[i]))
        return min(max(estimate, lowest), highest)

    position = q * (total - 1)
    below = int(np.floor(position))
    value = order_statistic(below)
    if below + 1 < total and position > below:
        value += (position - below) * (order_statistic(below + 1) - value)
    return value


def _argmin_search(cost: Callable[[np.ndarray], np.ndarray], n: int) -> int:
    """Index in range(n) of the smallest cost: every k-th candidate, then refine."""
    if n <= 2 * _COARSE_CANDIDATES:
        return int(np.argmin(cost(np.arange(n))))
    stride = -(-n // _COARSE_CANDIDATES)
    coarse = np.unique(np.append(np.arange(0, n, stride), n - 1))
    best = int(coarse[np.argmin(cost(coarse))])
    fine = np.arange(max(best - stride, 0), min(best + stride + 1, n))
    return int(fine[np.argmin(cost(fine))])


def _sawtooth_between(u0: np.ndarray, u1: np.ndarray) -> np.ndarray:
    """Integral of (t - round(t))**2 over [u0, u1], closed form: 1/12 per period."""
    n0, n1 = np.floor(u0 + 0.5), np.floor(u1 + 0.5)
    r0, r1 = u0 - n0, u1 - n1
    # r * r * r: numpy's ** 3 on float arrays goes through pow(), several times slower.
    return (n1 - n0) / 12.0 + (r1 * r1 * r1 - r0 * r0 * r0) / 3.0


class _UniformGridCost:
    """Total squared error of grids lo + k (hi - lo) / (levels - 1), clipped to [lo, hi].

    Values are assumed spread evenly within each bin. Rounding error integrates
    the sawtooth exactly over each bin (O(bins) per candidate), so spikes such
    as the exact zeros of a ReLU output cost what they really cost, not
    step**2 / 12; clipping error comes from prefix sums (O(log bins)).
    """

    def __init__(self, counts: np.ndarray, start: float, width: float):
        nonzero = np.flatnonzero(counts)
        self.left = start + width * nonzero.astype(np.float64)
        self.right = self.left + width
        self.mass = counts[nonzero].astype(np.float64)
        self.density = self.mass / width
        center = self.left + width / 2
        # Per bin, mass * E[x^k] for uniform x in the bin, k = 0, 1, 2; with a
        # leading zero so that sums over bins [i:j] are differences.
        moments = [self.mass, self.mass * center, self.mass * (center**2 + width**2 / 12)]
        self.prefix = [np.concatenate([[0.0], np.cumsum(m)]) for m in moments]

    def __call__(self, lo: np.ndarray, hi: np.ndarray, levels: int) -> np.ndarray:
        lo, hi = np.broadcast_arrays(np.asarray(lo, np.float64), np.asarray(hi, np.float64))
        step = ((hi - lo) / (levels - 1))[:, None]
        inside_left = (np.clip(self.left, lo[:, None], hi[:, None]) - lo[:, None]) / step
        inside_right = (np.clip(self.right, lo[:, None], hi[:, None]) - lo[:, None]) / step
        rounding = (_sawtooth_between(inside_left, inside_right) * self.density).sum(axis=-1)
        return step[:, 0] ** 3 * rounding + self._clipped(hi, above=True) + self._clipped(lo, above=False)

    def _clipped(self, edge: np.ndarray, *, above: bool) -> np.ndarray:
        """Squared distance to `edge` of the mass above (or below) it."""
        p0, p1, p2 = self.prefix
        if above:  # whole bins [i:] lie above; bin i - 1 may straddle the edge
            i = np.searchsorted(self.left, edge, side="left")
            whole = (p2[-1] - p2[i]) - 2 * edge * (p1[-1] - p1[i]) + edge**2 * (p0[-1] - p0[i])
            k = np.maximum(i - 1, 0)
            part = np.where(i > 0, self.density[k] * np.maximum(self.right[k] - edge, 0) ** 3 / 3, 0)
        else:  # whole bins [:i] lie below; bin i may straddle the edge
            i = np.searchsorted(self.right, edge, side="right")
            whole = p2[i] - 2 * edge * p1[i] + edge**2 * p0[i]
            k = np.minimum(i, len(self.left) - 1)
            part = np.where(
                i < len(self.left), self.density[k] * np.maximum(edge - self.left[k], 0) ** 3 / 3, 0
            )
        return np.maximum(whole, 0.0) + part


def _chunked(fn: Callable[[np.ndarray], np.ndarray], bins: int) -> Callable[[np.ndarray], np.ndarray]:
    """Evaluates fn over candidate indices in chunks that bound memory."""
    size = max(_CHUNK_ELEMENTS // max(bins, 1), 1)

    def cost(indices: np.ndarray) -> np.ndarray:
        return np.concatenate([fn(indices[i : i + size]) for i in range(0, len(indices), size)])

    return cost


def _candidate_edges(width: float, lo: float, hi: float) -> np.ndarray:
    """Multiples of `width` strictly inside (lo, hi], then hi itself."""
    first, last = int(np.floor(lo / width)) + 1, int(np.ceil(hi / width)) - 1
    return np.append(width * np.arange(first, last + 1, dtype=np.float64), hi)


def mse_threshold(counts: np.ndarray, limit: float, absmax: float, qtype: QType) -> float:
    """Symmetric clipping threshold T minimizing the expected squared error.

    The grid is narrow-range: k * T / qmax for |k| <= qmax on integer qtypes,
    T / qmax times the fp8 values, T times the nf4 levels. Candidates are the
    histogram's bin edges below the data's abs max, and the abs max itself.
    """
    width = 2.0 * limit / counts.shape[0]
    if absmax == 0.0:
        return 0.0
    candidates = _candidate_edges(width, 0.0, absmax)
    if qtype.kind == "int":
        grid_cost = _UniformGridCost(fold(counts), 0.0, width)
        levels, bins = 2 * int(qtype.qmax) + 1, len(grid_cost.left)

        def fn(idx: np.ndarray) -> np.ndarray:
            return grid_cost(-candidates[idx], candidates[idx], levels)
    else:
        # A non-uniform grid: evaluate the error at bin centers (sign matters for nf4).
        nonzero = np.flatnonzero(counts)
        centers = -limit + width * (nonzero + 0.5)
        mass, bins = counts[nonzero].astype(np.float64), len(nonzero)

        def fn(idx: np.ndarray) -> np.ndarray:
            t = candidates[idx][:, None]
            return (((_quantize_nonuniform(centers, t, qtype) - centers) ** 2) * mass).sum(-1)

    return float(candidates[_argmin_search(_chunked(fn, bins), len(candidates))])


def _quantize_nonuniform(x: np.ndarray, threshold: np.ndarray, qtype: QType) -> np.ndarray:
    if qtype.kind == "float":
        scale = threshold / qtype.qmax
        clipped = np.clip(x / scale, qtype.qmin, qtype.qmax)
        return clipped.astype(qtype.storage_dtype).astype(np.float64) * scale
    levels = NF4_LEVELS.astype(np.float64)  # sorted ascending
    nearest = np.searchsorted((levels[1:] + levels[:-1]) / 2, x / threshold)
    return levels[nearest] * threshold


def mse_range(
    counts: np.ndarray, limit: float, lo_data: float, hi_data: float, qtype: QType
) -> tuple[float, float]:
    """Asymmetric [lo, hi] (lo <= 0 <= hi) minimizing the expected squared error.

    A direct search: first the best common shrink of [lo_data, hi_data], then
    coordinate descent over the bin edges of each end, two rounds. The grid is
    lo + k * (hi - lo) / (qmax - qmin); the quantizer's nudge of the zero point
    onto an integer is not modeled.
    """
    if qtype.kind != "int":
        raise CalibrationError(
            f"MSE with an asymmetric range needs an integer qtype, got {qtype.name!r}; "
            "fp8 and nf4 are symmetric: pass symmetric=True."
        )
    lo_data, hi_data = min(lo_data, 0.0), max(hi_data, 0.0)
    if lo_data == hi_data:
        return 0.0, 0.0
    width = 2.0 * limit / counts.shape[0]
    grid_cost = _UniformGridCost(counts, -limit, width)
    levels = int(qtype.qmax - qtype.qmin) + 1

    def best(los: np.ndarray, his: np.ndarray) -> tuple[float, float]:
        los, his = np.broadcast_arrays(los, his)

        def fn(idx: np.ndarray) -> np.ndarray:
            return grid_cost(los[idx], his[idx], levels)

        i = _argmin_search(_chunked(fn, len(grid_cost.left)), len(los))
        return float(los[i]), float(his[i])

    shrink = np.arange(1, 1025, dtype=np.float64) / 1024
    lo, hi = best(shrink * lo_data, shrink * hi_data)
    for _ in range(2):
        if hi_data > 0:
            lo, hi = best(np.array(lo), _candidate_edges(width, 0.0, hi_data))
        if lo_data < 0:
            lo, hi = best(-_candidate_edges(width, 0.0, -lo_data), np.array(hi))
    return lo, hi


def _divergence(counts: np.ndarray, cumulative: np.ndarray, start: int, stop: int, levels: int) -> float:
    """KL(P || Q) of the window counts[start:stop] quantized to `levels` levels.

    P is the window with everything outside folded into its end bins; Q spreads
    each level's in-window mass evenly over that level's bins where P is
    non-zero. Where P has mass and Q none (a window end in an empty stretch
    below outliers), Q gets 1e-4 counts, as MXNet's reference smooths,
    instead of an infinite divergence that would forbid clipping there.
    """
    window = counts[start:stop].astype(np.float64)
    p = window.copy()
    p[0] += cumulative[start - 1] if start > 0 else 0
    p[-1] += cumulative[-1] - cumulative[stop - 1]
    nonzero = p > 0
    group = (np.arange(len(p)) * levels) // len(p)
    totals = np.bincount(group, weights=window, minlength=levels)
    occupied = np.bincount(group, weights=nonzero, minlength=levels)
    q = totals[group] / np.maximum(occupied[group], 1)
    p, q = p[nonzero], np.maximum(q[nonzero], 1e-4)
    p, q = p / p.sum(), q / q.sum()
    return float(np.sum(p * np.log(p / q)))


def _flatten_zero_spike(counts: np.ndarray, zero_bin: int) -> np.ndarray:
    """A copy whose bin holding zero has its largest neighbour's count.

    As NVIDIA's pytorch-quantization does before its KL search
    (`_compute_amax_entropy`): otherwise the exact zeros of a ReLU output,
    spread over a whole level by Q, dominate the divergence and pull the
    threshold far down.
    """
    counts = counts.copy()
    neighbours = counts[max(zero_bin - 1, 0) : zero_bin + 2 : 2] if zero_bin else counts[1:2]
    counts[zero_bin] = neighbours.max()
    return counts


def _kl_search(counts: np.ndarray, windows: list[tuple[int, int]], levels: int) -> int:
    cumulative = np.cumsum(counts)

    def cost(idx: np.ndarray) -> np.ndarray:
        return np.array([_divergence(counts, cumulative, *windows[i], levels) for i in idx])

    return _argmin_search(cost, len(windows))


def entropy_threshold(counts: np.ndarray, limit: float, absmax: float, levels: int) -> float:
    """Symmetric threshold by KL divergence over the |x| histogram (TensorRT).

    Candidate i keeps abs bins [0, i) and maps them onto `levels` levels
    (qmax + 1: 128 for int8, as TensorRT); the threshold is the kept bins'
    upper edge, at most `absmax`.
    """
    width = 2.0 * limit / counts.shape[0]
    folded = fold(counts)
    used = int(np.flatnonzero(folded)[-1]) + 1
    if used <= levels:
        return absmax  # the grid is already finer than the histogram
    windows = [(0, stop) for stop in range(levels, used + 1)]
    stop = windows[_kl_search(_flatten_zero_spike(folded, 0), windows, levels)][1]
    return min(stop * width, absmax)


def entropy_range(
    counts: np.ndarray, limit: float, lo_data: float, hi_data: float, levels: int
) -> tuple[float, float]:
    """Asymmetric [lo, hi] by KL divergence over the signed histogram.

    TensorRT's search is symmetric; here the candidates are windows around
    zero that shrink both ends of the data's extent by the same factor, each
    mapped onto all `levels` levels (256 for int8).
    """
    half = counts.shape[0] // 2
    width = 2.0 * limit / counts.shape[0]
    nonzero = np.flatnonzero(counts)
    below = max(half - int(nonzero[0]), 0)  # bins from the first non-empty one to 0
    above = max(int(nonzero[-1]) + 1 - half, 0)
    longest = max(below, above)
    windows = []
    for t in range(1, longest + 1):
        start = half - -(-below * t // longest)
        stop = half + -(-above * t // longest)
        if stop - start >= levels:
            windows.append((start, stop))
    if not windows:
        return lo_data, hi_data
    start, stop = windows[_kl_search(_flatten_zero_spike(counts, half), windows, levels)]
    return max((start - half) * width, lo_data), min((stop - half) * width, hi_data)
