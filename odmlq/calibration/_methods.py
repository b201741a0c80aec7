"""Calibration methods: frozen dataclasses that turn statistics into a range.

Each method knows its name (for `to_dict` and parsing), whether it needs a
histogram, and how to read a range out of `Statistics`. Public names are
re-exported by `odmlq.calibration`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

import numpy as np

from odmlq.calibration import _histogram
from odmlq.calibration._headroom import beyond_extreme
from odmlq.errors import CalibrationError
from odmlq.qtypes import QType

if TYPE_CHECKING:
    from odmlq.calibration._statistics import Statistics

_Range: TypeAlias = tuple[np.ndarray, np.ndarray]


def _real(owner: str, field: str, value: Any, valid: str, ok: Callable[[float], bool]) -> float:
    """`value` as a float, or a CalibrationError naming owner, field and valid values."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or not ok(float(value))
    ):
        raise CalibrationError(f"{owner}({field}={value!r}): {field} must be {valid}.")
    return float(value)


def _absmax(stats: Statistics) -> np.ndarray:
    return np.maximum(np.abs(stats.min), np.abs(stats.max))


def _histogram_of(method: Any, stats: Statistics) -> tuple[np.ndarray, float]:
    if stats.histogram is None or stats.histogram_limit is None:
        raise CalibrationError(
            f"{type(method).__name__} needs a histogram, but these statistics were "
            f"observed with a method that keeps none; observe with {method!r}."
        )
    return stats.histogram, float(stats.histogram_limit)


@dataclasses.dataclass(frozen=True)
class AbsMax:
    """Symmetric range ±clip_ratio·max|x|, whether or not `symmetric` is asked.

    Attributes:
      clip_ratio: scales the abs max; below 1 clips outliers, above 1 leaves
        headroom for values larger than any seen.
    """

    name: ClassVar[str] = "absmax"
    needs_histogram: ClassVar[bool] = False
    clip_ratio: float = 1.0

    def __post_init__(self):
        value = _real("AbsMax", "clip_ratio", self.clip_ratio,
                      "a finite number > 0, e.g. AbsMax(clip_ratio=0.9)", lambda v: v > 0)
        object.__setattr__(self, "clip_ratio", value)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.name, "clip_ratio": self.clip_ratio}

    def _range(self, stats: Statistics, qtype: QType, symmetric: bool) -> _Range:
        bound = self.clip_ratio * _absmax(stats)
        return -bound, bound


@dataclasses.dataclass(frozen=True, repr=False)
class MinMax:
    """The global min and max of everything seen (symmetric: ±max|x|).

    Attributes:
      headroom: extend each end past the extreme seen by what minimizes the
        expected error on data the calibration did not see (odmlq's default
        for activations). The extreme of ``n`` values is exceeded by about
        one new value in ``n``; by how much follows from the tail of the data,
        read off its `EXTREMES` most extreme values (`_headroom`) as an exponential tail of
        scale ``sigma`` (their mean distance beyond the next one). Widening by
        ``d`` costs every value rounding error ``(range + d)**2 / (12
        levels**2)`` and saves ``2 sigma**2 exp(-d / sigma) / n`` of clipping
        error; the minimum of the sum is the headroom. Many values or a
        bounded tail (ties at the extreme: pixels at 1.0, ReLU zeros) give
        none; a few hundred values of a logit give a few percent of the range.
        At most `HEADROOM_LIMIT` of the range seen on each side (`_headroom`).
    """

    name: ClassVar[str] = "minmax"
    needs_histogram: ClassVar[bool] = False
    headroom: bool = False

    def __post_init__(self):
        if not isinstance(self.headroom, bool):
            raise CalibrationError(f"MinMax(headroom={self.headroom!r}): headroom must be True or False.")

    def __repr__(self) -> str:
        return "MinMax(headroom=True)" if self.headroom else "MinMax()"

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.name, **({"headroom": True} if self.headroom else {})}

    def _range(self, stats: Statistics, qtype: QType, symmetric: bool) -> _Range:
        if not self.headroom:
            return stats.min, stats.max
        if stats.top is None or stats.bottom is None:
            raise CalibrationError(
                "MinMax(headroom=True) needs the most extreme values, but these statistics were "
                "observed with another method; observe with MinMax(headroom=True).")
        width = np.maximum(stats.max, 0.0) - np.minimum(stats.min, 0.0)
        levels = float(qtype.qmax - qtype.qmin)
        high = beyond_extreme(stats.top - stats.top[..., -1:], width, stats.count, levels)
        low = beyond_extreme(stats.bottom[..., -1:] - stats.bottom, width, stats.count, levels)
        return stats.min - low, stats.max + high


@dataclasses.dataclass(frozen=True)
class MovingAverageMinMax:
    """Exponential moving average of each batch's min and max.

    After the first batch, ``average = momentum * average + (1 - momentum) *
    batch_value``, as TFLite's and PyTorch's moving-average observers do. The
    result depends on batch order and batch size, so `merge` cannot be exact:
    it takes the average of the two sides weighted by their element counts.

    Attributes:
      momentum: weight of the running average, in [0, 1).
    """

    name: ClassVar[str] = "moving_average_minmax"
    needs_histogram: ClassVar[bool] = False
    momentum: float = 0.9

    def __post_init__(self):
        value = _real("MovingAverageMinMax", "momentum", self.momentum,
                      "a number in [0, 1), e.g. 0.9", lambda v: 0 <= v < 1)
        object.__setattr__(self, "momentum", value)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.name, "momentum": self.momentum}

    def _range(self, stats: Statistics, qtype: QType, symmetric: bool) -> _Range:
        if stats.moving_min is None or stats.moving_max is None:
            raise CalibrationError(
                "MovingAverageMinMax needs moving averages, but these statistics were "
                "observed with another method; observe with MovingAverageMinMax()."
            )
        return stats.moving_min, stats.moving_max


@dataclasses.dataclass(frozen=True)
class RMS:
    """A range from the root mean square, never wider than the data.

    Symmetric: ±multiplier·sqrt(mean(x²)) (the mean offset counts towards the
    width). Asymmetric: mean ± multiplier·std. Either is clipped to the
    observed [min, max], so bounded data does not get a range it never uses.
    std comes from float64 sums of x and x², exact enough unless
    |mean| / std exceeds about 1e6.

    Attributes:
      multiplier: how many RMS (or standard deviations) the range spans.
    """

    name: ClassVar[str] = "rms"
    needs_histogram: ClassVar[bool] = False
    multiplier: float = 4.0

    def __post_init__(self):
        value = _real("RMS", "multiplier", self.multiplier,
                      "a finite number > 0, e.g. RMS(multiplier=4.0)", lambda v: v > 0)
        object.__setattr__(self, "multiplier", value)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.name, "multiplier": self.multiplier}

    def _range(self, stats: Statistics, qtype: QType, symmetric: bool) -> _Range:
        mean = stats.sum / stats.count
        mean_square = stats.sum_of_squares / stats.count
        if symmetric:
            bound = np.minimum(self.multiplier * np.sqrt(mean_square), _absmax(stats))
            return -bound, bound
        spread = self.multiplier * np.sqrt(np.maximum(mean_square - mean**2, 0.0))
        return np.maximum(mean - spread, stats.min), np.minimum(mean + spread, stats.max)


@dataclasses.dataclass(frozen=True)
class FixedRange:
    """A range fixed in advance (e.g. [0, 6] after ReLU6); the data is ignored.

    Widened to contain zero like every range; symmetric: ±max(|min|, |max|).
    """

    name: ClassVar[str] = "fixed_range"
    needs_histogram: ClassVar[bool] = False
    min: float
    max: float

    def __post_init__(self):
        for field in ("min", "max"):
            value = _real("FixedRange", field, getattr(self, field), "a finite number",
                          lambda v: True)
            object.__setattr__(self, field, value)
        if not self.min < self.max:
            raise CalibrationError(
                f"FixedRange(min={self.min!r}, max={self.max!r}): min must be less "
                "than max, e.g. FixedRange(min=0.0, max=6.0)."
            )

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.name, "min": self.min, "max": self.max}

    def _range(self, stats: Statistics | None, qtype: QType, symmetric: bool) -> _Range:
        shape = () if stats is None else stats.min.shape
        return np.full(shape, self.min), np.full(shape, self.max)


@dataclasses.dataclass(frozen=True)
class Percentile:
    """Clips at a percentile, read from the histogram.

    Symmetric: ±(the percentile of |x|). Asymmetric: the (100 - p)-th and p-th
    percentiles of x. Within one histogram bin of `np.percentile` (numpy's
    default linear interpolation); Percentile(100) is the data's exact range.

    Attributes:
      percentile: in (50, 100]; 100 is the abs max (or min and max).
    """

    name: ClassVar[str] = "percentile"
    needs_histogram: ClassVar[bool] = True
    percentile: float = 99.99

    def __post_init__(self):
        value = _real("Percentile", "percentile", self.percentile,
                      "a number in (50, 100], e.g. Percentile(99.99)", lambda v: 50 < v <= 100)
        object.__setattr__(self, "percentile", value)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.name, "percentile": self.percentile}

    def _range(self, stats: Statistics, qtype: QType, symmetric: bool) -> _Range:
        counts, limit = _histogram_of(self, stats)
        width = 2.0 * limit / counts.shape[0]
        q = self.percentile / 100.0
        if symmetric:
            absmax = float(_absmax(stats))
            folded = _histogram.fold(counts)
            # |x| has no known minimum; 0 is a bound, and p > 50 never reads it.
            bound = _histogram.quantile(folded, 0.0, width, q, 0.0, absmax)
            return np.asarray(-bound), np.asarray(bound)
        lowest, highest = float(stats.min), float(stats.max)
        lo = _histogram.quantile(counts, -limit, width, 1.0 - q, lowest, highest)
        hi = _histogram.quantile(counts, -limit, width, q, lowest, highest)
        return np.asarray(lo), np.asarray(hi)


@dataclasses.dataclass(frozen=True)
class MSE:
    """The clipping range that minimizes the expected quantization error.

    The error counts both rounding inside the range and clipping outside it,
    on the qtype's own grid (narrow-range when symmetric), assuming values
    spread evenly within each histogram bin. A direct search over histogram
    bin edges (coarse, then refined around the best); asymmetric ranges use a
    common shrink of [min, max] then coordinate descent on each end. fp8 and
    nf4 grids are supported symmetric only.

    Squared error weighs an outlier by its squared distance: a handful of huge
    outliers in a small calibration set are kept, not clipped. That is the
    MSE-optimal answer; use Percentile or Entropy to clip them regardless.

    References:
      Banner et al., "Post training 4-bit quantization of convolutional
      networks for rapid-deployment", NeurIPS 2019 (the rounding + clipping
      error model); here minimized numerically, not in closed form.
    """

    name: ClassVar[str] = "mse"
    needs_histogram: ClassVar[bool] = True

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.name}

    def _range(self, stats: Statistics, qtype: QType, symmetric: bool) -> _Range:
        counts, limit = _histogram_of(self, stats)
        return _mse_search(counts, limit, stats, qtype, symmetric)


def _mse_search(counts: np.ndarray, limit: float, stats: Statistics, qtype: QType, symmetric: bool) -> _Range:
    """The range minimizing the squared error the (weighted) histogram counts."""
    if symmetric:
        bound = _histogram.mse_threshold(counts, limit, float(_absmax(stats)), qtype)
        return np.asarray(-bound), np.asarray(bound)
    lo, hi = _histogram.mse_range(counts, limit, float(stats.min), float(stats.max), qtype)
    return np.asarray(lo), np.asarray(hi)


@dataclasses.dataclass(frozen=True)
class RelativeMSE:
    """The clipping range that minimizes the expected squared *relative* error.

    `MSE` with each value's error divided by the value: ``((x - q(x)) / x)^2``.
    For a factor that multiplies other values (a norm's ``rsqrt(var + eps)``),
    whose relative error is the product's: a few rows of small variance, whose
    factor is 100x the others', would otherwise take the whole range, and every
    other row's factor would be a few steps of it. Weighted per histogram bin
    by 1 / (bin centre)^2; the resolution is the histogram's.
    """

    name: ClassVar[str] = "relative_mse"
    needs_histogram: ClassVar[bool] = True

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.name}

    def _range(self, stats: Statistics, qtype: QType, symmetric: bool) -> _Range:
        counts, limit = _histogram_of(self, stats)
        width = 2.0 * limit / counts.shape[0]
        centres = -limit + width * (np.arange(counts.shape[0]) + 0.5)
        weighted = counts / np.maximum(centres * centres, width * width / 4)
        return _mse_search(weighted, limit, stats, qtype, symmetric)


@dataclasses.dataclass(frozen=True)
class Entropy:
    """The clipping threshold whose quantized distribution loses least information.

    Minimizes KL(P || Q) between the histogram clipped at a candidate
    threshold (outliers folded into the last bin) and the same histogram
    quantized to the qtype's levels. Symmetric: TensorRT's search over |x| with
    qmax + 1 levels. Asymmetric: windows shrinking both ends of [min, max] by
    one factor, with qmax - qmin + 1 levels. Integer qtypes only. Two
    details follow reference implementations: the bin holding zero takes its
    neighbour's count (so the exact zeros of ReLU outputs do not drag the
    threshold down), and Q gets a tiny count where it is empty but P is not
    (instead of an infinite divergence). The resolution is the histogram's:
    the threshold is at least qmax + 1 bins, which huge outliers make wide.

    References:
      Migacz, "8-bit Inference with TensorRT", GPU Technology Conference 2017.
      NVIDIA pytorch-quantization, `_compute_amax_entropy` (the zero bin).
      Apache MXNet, `_get_optimal_threshold` (smoothing of Q).
    """

    name: ClassVar[str] = "entropy"
    needs_histogram: ClassVar[bool] = True

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.name}

    def _range(self, stats: Statistics, qtype: QType, symmetric: bool) -> _Range:
        counts, limit = _histogram_of(self, stats)
        if qtype.kind != "int":
            raise CalibrationError(
                f"Entropy needs an integer qtype, got {qtype.name!r}; use MSE() or "
                "Percentile() for fp8 and nf4."
            )
        if symmetric:
            levels = int(qtype.qmax) + 1
            bound = _histogram.entropy_threshold(counts, limit, float(_absmax(stats)), levels)
            return np.asarray(-bound), np.asarray(bound)
        levels = int(qtype.qmax - qtype.qmin) + 1
        lo, hi = _histogram.entropy_range(counts, limit, float(stats.min), float(stats.max), levels)
        return np.asarray(lo), np.asarray(hi)
