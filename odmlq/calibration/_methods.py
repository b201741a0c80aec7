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


@dataclasses.dataclass(frozen=True)
class MinMax:
    """The global min and max of everything seen (symmetric: ±max|x|)."""

    name: ClassVar[str] = "minmax"
    needs_histogram: ClassVar[bool] = False

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.name}

    def _range(self, stats: Statistics, qtype: QType, symmetric: bool) -> _Range:
        return stats.min, stats.max


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
        if symmetric:
            bound = _histogram.mse_threshold(weighted, limit, float(_absmax(stats)), qtype)
            return np.asarray(-bound), np.asarray(bound)
        lo, hi = _histogram.mse_range(weighted, limit, float(stats.min), float(stats.max), qtype)
        return np.asarray(lo), np.asarray(hi)


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


# A value this large is an attention mask's "minus infinity"
# (finfo(float32).min, -1e9), not data.
MASK_SENTINEL = 1e8


@dataclasses.dataclass(frozen=True)
class Masked:
    """A range for an edge that carries an attention mask's sentinel.

    Masks are written as ``where(mask, x, finfo(float32).min)`` or as an
    additive bias of 0 and ``finfo.min``. Those values are no data: observed
    as data they make the range ~1e38 wide (every real value rounds to zero,
    and LiteRT aborted on such a scale). `Masked` leaves values with
    ``|x| >= sentinel`` out of the statistics and places them at the bottom
    of the range, which it extends below the data by ``bits * ln 2 + 1``: a
    masked score then lies that far below every row's maximum, so its
    softmax weight (``exp(-(bits ln 2 + 1))``, under one step of the
    softmax's output) rounds to zero as the sentinel's does. An edge whose
    other values are all equal (the additive bias itself: 0 and the
    sentinel) gets ``[hi - 64, hi]``: the mask as a finite bias of -64, far
    below any attention score's range yet close enough to the scores' scale
    for integer ADD kernels (XNNPACK takes input-to-output scale ratios up to
    256; a bias of -1e4 was off by the whole range).

    odmlq's plan applies it by itself to edges a mask constant reaches; the
    inner method calibrates the rest.
    """

    name: ClassVar[str] = "masked"
    method: Any = dataclasses.field(default_factory=lambda: MinMax())
    sentinel: float = MASK_SENTINEL

    def __post_init__(self):
        object.__setattr__(self, "method", parse_calibration_method(self.method))
        if isinstance(self.method, Masked):
            object.__setattr__(self, "method", self.method.method)
        value = _real("Masked", "sentinel", self.sentinel, "a number > 0, e.g. 1e8", lambda v: v > 0)
        object.__setattr__(self, "sentinel", value)

    @property
    def needs_histogram(self) -> bool:
        return self.method.needs_histogram

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.name, "inner": self.method.to_dict(), "sentinel": self.sentinel}

    def _range(self, stats: Statistics, qtype: QType, symmetric: bool) -> _Range:
        lo, hi = self.method._range(stats, qtype, symmetric)
        lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
        pad = qtype.bits * math.log(2.0) + 1.0
        degenerate = np.all(hi - lo <= 1e-6 * np.maximum(1.0, np.abs(hi)))
        return (hi - 64.0 if degenerate else lo - pad), hi


@dataclasses.dataclass(frozen=True)
class Capped:
    """A range from the values below `cap` only; values at or above it clip
    to the top of the range.

    For a quantity whose large values carry no information downstream. A
    norm's ``rsqrt(var + eps)`` is the case odmlq's plan applies it to by
    itself, with ``cap = 1 / sqrt(2 eps)``: a row whose variance is under the
    norm's own eps (a row a ReLU zeroed) has ``rsqrt`` near ``1/sqrt(eps)``
    (1000 for eps 1e-6), and calibrated as data that one row would leave the
    other rows' ``1/sigma`` less than one step of the range. Such a row's
    centered values are (near) zero, so clipping its factor changes nothing
    that is read. The inner method calibrates the rest.
    """

    name: ClassVar[str] = "capped"
    cap: float
    method: Any = dataclasses.field(default_factory=lambda: MinMax())

    def __post_init__(self):
        object.__setattr__(self, "method", parse_calibration_method(self.method))
        if isinstance(self.method, (Masked, Capped)):
            raise CalibrationError(f"Capped wraps a plain method, not {self.method!r}.")
        value = _real("Capped", "cap", self.cap, "a finite number > 0, e.g. 707.1",
                      lambda v: v > 0 and math.isfinite(v))
        object.__setattr__(self, "cap", value)

    @property
    def needs_histogram(self) -> bool:
        return self.method.needs_histogram

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.name, "inner": self.method.to_dict(), "cap": self.cap}

    def _range(self, stats: Statistics, qtype: QType, symmetric: bool) -> _Range:
        return self.method._range(stats, qtype, symmetric)


CalibrationMethod: TypeAlias = (
    AbsMax | MinMax | MovingAverageMinMax | RMS | FixedRange | Percentile | MSE | Entropy | Masked
    | Capped | RelativeMSE
)

CALIBRATION_METHODS: dict[str, type] = {
    "absmax": AbsMax,
    "minmax": MinMax,
    "moving_average_minmax": MovingAverageMinMax,
    "rms": RMS,
    "fixed_range": FixedRange,
    "percentile": Percentile,
    "mse": MSE,
    "relative_mse": RelativeMSE,
    "entropy": Entropy,
    "masked": Masked,
    "capped": Capped,
}


def calibration_method_from_dict(d: dict[str, Any]) -> CalibrationMethod:
    """Rebuilds a method from its `to_dict()`.

    Example:
      >>> calibration_method_from_dict({'method': 'percentile', 'percentile': 99.9})
      Percentile(percentile=99.9)
    """
    if not isinstance(d, dict) or "method" not in d:
        raise CalibrationError(
            f"A calibration method dict needs a 'method' key, e.g. {{'method': 'minmax'}}; got {d!r}."
        )
    cls = _method_class(d["method"])
    if cls in (Masked, Capped):
        d = {("method" if k == "inner" else k): v for k, v in d.items() if k != "method"}
        return cls(**d)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields - {"method"})
    if unknown:
        raise CalibrationError(
            f"Calibration method {d['method']!r} has no field(s) {unknown}; "
            f"its fields are {sorted(fields)}."
        )
    try:
        return cls(**{k: v for k, v in d.items() if k != "method"})
    except TypeError as e:  # a required field (FixedRange's min/max) is missing
        raise CalibrationError(
            f"Calibration method {d!r} is incomplete: its fields are {sorted(fields)}."
        ) from e


def parse_calibration_method(value: CalibrationMethod | dict[str, Any] | str) -> CalibrationMethod:
    """A method from a method object, its dict, or a bare name with default fields.

    Example:
      >>> parse_calibration_method('absmax')
      AbsMax(clip_ratio=1.0)
    """
    if isinstance(value, tuple(CALIBRATION_METHODS.values())):
        return value
    if isinstance(value, dict):
        return calibration_method_from_dict(value)
    if isinstance(value, str):
        return calibration_method_from_dict({"method": value})
    raise CalibrationError(
        f"A calibration method is a method object (e.g. MinMax(), Percentile(99.99)), "
        f"its dict or one of the names {sorted(CALIBRATION_METHODS)}; got {value!r}."
    )


def _method_class(name: Any) -> type:
    if name not in CALIBRATION_METHODS:
        raise CalibrationError(
            f"Unknown calibration method {name!r}; choose one of {sorted(CALIBRATION_METHODS)}."
        )
    return CALIBRATION_METHODS[name]
