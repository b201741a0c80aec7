"""Statistics of a tensor, streamed batch by batch: observe, merge, compute_range.

Public names are re-exported by `odmlq.calibration`.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from odmlq.calibration import _histogram
from odmlq.calibration._headroom import EXTREMES
from odmlq.calibration._methods import FixedRange, MinMax, MovingAverageMinMax
from odmlq.calibration._wrapped import Capped, CalibrationMethod, Masked, parse_calibration_method
from odmlq.errors import CalibrationError
from odmlq.qtypes import QType
from odmlq.qtypes import qtype as to_qtype


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "count", "min", "max", "sum", "sum_of_squares", "batches",
        "moving_min", "moving_max", "histogram", "histogram_limit", "top", "bottom",
    ],
    meta_fields=["keep_axes"],
)
@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Statistics:
    """Streamed statistics of one tensor, a pytree of numpy arrays.

    Per-channel arrays have the shape of the kept axes, in `keep_axes` order
    (scalars for per-tensor statistics). Accumulators are float64: a float32
    sum over millions of activations would lose the low digits of the RMS.

    Attributes:
      count: int64, elements seen per channel.
      min, max: float64, per channel.
      sum, sum_of_squares: float64, per channel.
      batches: int64, batches seen.
      moving_min, moving_max: float64 per channel; only for MovingAverageMinMax.
      histogram: int64 (HISTOGRAM_BINS,) counts over [-histogram_limit,
        histogram_limit); only for methods with `needs_histogram`, per tensor.
      histogram_limit: float64 scalar, a power of two: the smallest one
        strictly above every |x| seen. Growing it merges bins exactly, so
        histograms merge exactly whatever the order of batches. The bin
        width is limit / 2048: one huge outlier coarsens the bins of the
        whole tensor, and with them Percentile, MSE and Entropy.
      top, bottom: float64 per channel, the `EXTREMES` largest values (most
        extreme first) and smallest (least first) seen, last axis; fewer
        while fewer were seen. Only for ``MinMax(headroom=True)``.
      keep_axes: the axes the statistics are kept along (static).
    """

    count: np.ndarray
    min: np.ndarray
    max: np.ndarray
    sum: np.ndarray
    sum_of_squares: np.ndarray
    batches: np.ndarray
    moving_min: np.ndarray | None = None
    moving_max: np.ndarray | None = None
    histogram: np.ndarray | None = None
    histogram_limit: np.ndarray | None = None
    top: np.ndarray | None = None
    bottom: np.ndarray | None = None
    keep_axes: tuple[int, ...] = ()


def _keep_axes(keep_axes: Sequence[int]) -> tuple[int, ...]:
    axes = tuple(keep_axes)
    if any(isinstance(a, bool) or not isinstance(a, numbers.Integral) for a in axes):
        raise CalibrationError(f"keep_axes must be a sequence of ints, got {keep_axes!r}.")
    return tuple(int(a) for a in axes)


def _base(method: CalibrationMethod) -> CalibrationMethod:
    """The method whose statistics `method` keeps (`Masked` and `Capped` keep their inner method's)."""
    return method.method if isinstance(method, (Masked, Capped)) else method


def keeps_extremes(method: CalibrationMethod) -> bool:
    base = _base(method)
    return isinstance(base, MinMax) and base.headroom


def _extremes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(top, bottom) along the last axis: the `EXTREMES` largest values, largest
    first, and smallest, smallest first."""
    k = min(EXTREMES, values.shape[-1])
    top = -np.sort(-np.partition(values, values.shape[-1] - k, axis=-1)[..., values.shape[-1] - k:], axis=-1)
    bottom = np.sort(np.partition(values, k - 1, axis=-1)[..., :k], axis=-1)
    return top, bottom


def _batch_statistics(method: CalibrationMethod, x: Any, keep_axes: tuple[int, ...]) -> Statistics:
    if isinstance(method, Masked):
        # A mask's sentinels are no data (see `Masked`); a batch of nothing but
        # them observes one zero.
        values = np.asarray(x, np.float64)
        if keep_axes:
            raise CalibrationError("Masked calibration is per tensor; give it no keep_axes.")
        data = values[np.abs(values) < method.sentinel]
        return _batch_statistics(method.method, data if data.size else np.zeros(1), ())
    if isinstance(method, Capped):
        # Values at or above the cap are no data (see `Capped`): a few rows. Where
        # they are most of a batch, the cap's premise fails (a norm whose
        # inputs' mean square is about its eps: weights initialized at 0.01,
        # as Flax's Gemma example does), and the batch is observed whole: left
        # out, the range was a zero's and clipped every value.
        values = np.asarray(x, np.float64)
        if keep_axes:
            raise CalibrationError("Capped calibration is per tensor; give it no keep_axes.")
        data = values[values < method.cap]
        return _batch_statistics(method.method, data if 2 * data.size > values.size else values, ())
    values = np.asarray(x)
    if np.iscomplexobj(values) or values.dtype == object:
        raise CalibrationError(f"Calibration needs real numbers, got dtype {values.dtype}.")
    values = values.astype(np.float64)
    if values.size == 0:
        raise CalibrationError(f"The batch is empty (shape {values.shape}); nothing to observe.")
    non_finite = values.size - np.count_nonzero(np.isfinite(values))
    if non_finite:
        raise CalibrationError(
            f"The batch has {non_finite} non-finite values (NaN or Inf) out of "
            f"{values.size}; calibrate on finite data (check the inputs and for overflow)."
        )
    normalized = tuple(a + values.ndim if a < 0 else a for a in keep_axes)
    if any(not 0 <= a < values.ndim for a in normalized) or len(set(normalized)) < len(normalized):
        raise CalibrationError(
            f"keep_axes={keep_axes} does not fit a tensor of shape {values.shape}: "
            f"axes must be distinct and in [-{values.ndim}, {values.ndim})."
        )
    kept = np.moveaxis(values, normalized, tuple(range(len(normalized))))
    flat = kept.reshape(kept.shape[: len(normalized)] + (-1,))
    low, high = np.asarray(flat.min(-1)), np.asarray(flat.max(-1))
    moving = isinstance(_base(method), MovingAverageMinMax)
    histogram = limit = None
    if method.needs_histogram:
        limit = _histogram.limit_for(float(max(-low, high)))
        histogram = _histogram.build(flat, limit)
    top, bottom = _extremes(flat) if keeps_extremes(method) else (None, None)
    return Statistics(
        count=np.asarray(flat.shape[-1], np.int64),
        min=low,
        max=high,
        sum=np.asarray(flat.sum(-1)),
        # einsum: the sum of squares without a squared copy of the batch.
        sum_of_squares=np.asarray(np.einsum("...i,...i->...", flat, flat)),
        batches=np.asarray(1, np.int64),
        moving_min=low if moving else None,
        moving_max=high if moving else None,
        histogram=histogram,
        histogram_limit=None if limit is None else np.asarray(limit),
        top=top,
        bottom=bottom,
        keep_axes=keep_axes,
    )


def _check_compatible(method: CalibrationMethod, *stats: Statistics) -> None:
    first = stats[0]
    moving = isinstance(_base(method), MovingAverageMinMax)
    for s in stats:
        if s.keep_axes != first.keep_axes or s.min.shape != first.min.shape:
            raise CalibrationError(
                f"Statistics kept along axes {first.keep_axes} (shape {first.min.shape}) "
                f"and {s.keep_axes} (shape {s.min.shape}) cannot be combined; "
                "observe every batch of a tensor with the same keep_axes."
            )
        if ((s.histogram is not None) != method.needs_histogram or (s.moving_min is not None) != moving
                or (s.top is not None) != keeps_extremes(method)):
            raise CalibrationError(
                f"These statistics were not observed with {method!r} (it "
                f"{'keeps' if method.needs_histogram else 'keeps no'} histogram and "
                f"{'keeps' if moving else 'keeps no'} moving averages, "
                f"{'keeps' if keeps_extremes(method) else 'keeps no'} extreme values); use one method per tensor."
            )


def _combine(a: Statistics, b: Statistics, moving: tuple[Any, Any]) -> Statistics:
    histogram = limit = None
    if a.histogram is not None:
        histogram, limit = _histogram.merge(
            a.histogram, float(a.histogram_limit), b.histogram, float(b.histogram_limit)
        )
    top = bottom = None
    if a.top is not None:
        top = _extremes(np.concatenate([a.top, b.top], axis=-1))[0]
        bottom = _extremes(np.concatenate([a.bottom, b.bottom], axis=-1))[1]
    return Statistics(
        count=a.count + b.count,
        min=np.minimum(a.min, b.min),
        max=np.maximum(a.max, b.max),
        sum=a.sum + b.sum,
        sum_of_squares=a.sum_of_squares + b.sum_of_squares,
        batches=a.batches + b.batches,
        moving_min=moving[0],
        moving_max=moving[1],
        histogram=histogram,
        histogram_limit=None if limit is None else np.asarray(limit),
        top=top,
        bottom=bottom,
        keep_axes=a.keep_axes,
    )


def observe(
    method: CalibrationMethod | dict[str, Any] | str,
    stats: Statistics | None,
    x: Any,
    *,
    keep_axes: Sequence[int] = (),
) -> Statistics:
    """Folds one batch `x` (numpy or jax array) into `stats` (None: start afresh).

    Args:
      method: the calibration method; decides which optional statistics
        (histogram, moving averages) are kept.
      stats: statistics of the batches so far, or None.
      x: the batch; converted to float64.
      keep_axes: axes kept per channel (e.g. (-1,) for per-channel ranges
        along the last axis); () for per tensor.

    Returns:
      New statistics; `stats` is not modified.

    Raises:
      CalibrationError: x has NaN or Inf, is empty, keep_axes do not fit, a
        histogram method is asked per channel, or `stats` came from another
        method or other keep_axes.

    Example:
      >>> from odmlq.calibration import MinMax
      >>> s = observe(MinMax(), None, np.array([1.0, -2.0]))
      >>> s = observe(MinMax(), s, np.array([5.0]))
      >>> float(s.max), int(s.count)
      (5.0, 3)
    """
    method = parse_calibration_method(method)
    keep_axes = _keep_axes(keep_axes)
    if method.needs_histogram and keep_axes:
        raise CalibrationError(
            f"{method!r} with keep_axes={keep_axes}: Percentile, MSE and Entropy "
            "support per-tensor activations only (keep_axes=()); use MinMax() or "
            "AbsMax() for per-channel ranges."
        )
    return _folded(method, stats, _batch_statistics(method, x, keep_axes))


def observe_parts(
    method: CalibrationMethod | dict[str, Any] | str,
    stats: Statistics | None,
    parts: Sequence[Any],
    *,
    keep_axes: Sequence[int] = (),
) -> Statistics:
    """Folds one batch given as disjoint parts (its shards on several devices)
    into `stats`: exactly what `observe` of the whole batch gives for counts,
    minima, maxima, extremes, histograms and moving averages; sums up to
    float64 rounding. The parts may split any axis but a kept one.

    Raises:
      CalibrationError: as `observe`; parts of different kept shapes.

    Example:
      >>> from odmlq.calibration import MinMax
      >>> s = observe_parts(MinMax(), None, [np.array([1.0, -2.0]), np.array([5.0])])
      >>> float(s.max), int(s.count), int(s.batches)
      (5.0, 3, 1)
    """
    method = parse_calibration_method(method)
    return _folded(method, stats, one_batch(method, [observe(method, None, part, keep_axes=keep_axes)
                                                     for part in parts]))


def one_batch(method: CalibrationMethod, parts: Sequence[Statistics]) -> Statistics:
    """The statistics of disjoint parts of one batch merged, counted as that
    one batch (its moving extremes are its own extremes)."""
    stats = functools.reduce(lambda a, b: merge(method, a, b), parts)
    moving = {}
    if stats.moving_min is not None:
        moving = dict(moving_min=stats.min, moving_max=stats.max)
    return dataclasses.replace(stats, batches=np.asarray(1, np.int64), **moving)


def _folded(method: CalibrationMethod, stats: Statistics | None, batch: Statistics) -> Statistics:
    """`stats` with one more batch's statistics."""
    if stats is None:
        return batch
    _check_compatible(method, stats, batch)
    moving = (None, None)
    if isinstance(_base(method), MovingAverageMinMax):
        m = method.momentum
        moving = (
            m * stats.moving_min + (1.0 - m) * batch.moving_min,
            m * stats.moving_max + (1.0 - m) * batch.moving_max,
        )
    return _combine(stats, batch, moving)


def merge(method: CalibrationMethod | dict[str, Any] | str, a: Statistics, b: Statistics) -> Statistics:
    """Combines statistics of disjoint data (other batches, other processes).

    Exact for counts, min, max and histograms; sums up to float64 rounding.
    Moving averages take the count-weighted average of the two sides, which
    is not what one stream over all batches would have given.

    Example:
      >>> from odmlq.calibration import MinMax
      >>> a = observe(MinMax(), None, np.array([1.0]))
      >>> b = observe(MinMax(), None, np.array([-3.0]))
      >>> float(merge(MinMax(), a, b).min)
      -3.0
    """
    method = parse_calibration_method(method)
    _check_compatible(method, a, b)
    moving = (None, None)
    if isinstance(_base(method), MovingAverageMinMax):
        total = a.count + b.count
        moving = (
            (a.count * a.moving_min + b.count * b.moving_min) / total,
            (a.count * a.moving_max + b.count * b.moving_max) / total,
        )
    return _combine(a, b, moving)


def compute_range(
    method: CalibrationMethod | dict[str, Any] | str,
    stats: Statistics | None,
    qtype: QType | str,
    *,
    symmetric: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """The float range [lo, hi] to quantize with, from statistics.

    Args:
      method: the calibration method.
      stats: what `observe` collected; None only for FixedRange.
      qtype: the quantized type (or its name); MSE and Entropy fit its grid.
      symmetric: return lo == -hi.

    Returns:
      (lo, hi), float32 arrays shaped like the kept axes (0-d per tensor),
      with lo <= 0 <= hi.

    Example:
      >>> from odmlq.calibration import AbsMax
      >>> s = observe(AbsMax(), None, np.array([-1.0, 4.0]))
      >>> compute_range(AbsMax(), s, 'int8', symmetric=True)
      (array(-4., dtype=float32), array(4., dtype=float32))
    """
    method = parse_calibration_method(method)
    qtype = to_qtype(qtype)
    if stats is None and not isinstance(method, FixedRange):
        raise CalibrationError(
            f"{method!r} needs statistics; observe at least one batch first."
        )
    lo, hi = method._range(stats, qtype, bool(symmetric))
    lo, hi = np.minimum(lo, 0.0), np.maximum(hi, 0.0)
    if symmetric:
        hi = np.maximum(-lo, hi)
        lo = -hi
    return np.asarray(lo, np.float32), np.asarray(hi, np.float32)
