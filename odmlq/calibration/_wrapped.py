"""Methods that wrap another (a mask's sentinel, a cap), and parsing any
method from its name or dict. Public names are re-exported by
`odmlq.calibration`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

import numpy as np

from odmlq.calibration._methods import (
    MSE,
    RMS,
    AbsMax,
    Entropy,
    FixedRange,
    MinMax,
    MovingAverageMinMax,
    Percentile,
    RelativeMSE,
    _Range,
    _real,
)
from odmlq.errors import CalibrationError
from odmlq.qtypes import QType

if TYPE_CHECKING:
    from odmlq.calibration._statistics import Statistics


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

    A mask written as a positive sentinel that is subtracted later
    (DistilBERT's ``scores - 1e30 * (1 - mask)``) has its edge calibrated with
    ``top=True``: the sentinels go to the top of the range, extended above
    the data the same way (``[lo, lo + 64]`` for the bias itself).

    odmlq's plan applies it by itself to edges a mask constant reaches, with
    the sentinel's sign followed through the ops; the inner method
    calibrates the rest.
    """

    name: ClassVar[str] = "masked"
    method: Any = dataclasses.field(default_factory=lambda: MinMax())
    sentinel: float = MASK_SENTINEL
    top: bool = False

    def __post_init__(self):
        object.__setattr__(self, "method", parse_calibration_method(self.method))
        if isinstance(self.method, Masked):
            object.__setattr__(self, "method", self.method.method)
        value = _real("Masked", "sentinel", self.sentinel, "a number > 0, e.g. 1e8", lambda v: v > 0)
        object.__setattr__(self, "sentinel", value)
        if not isinstance(self.top, bool):
            raise CalibrationError(f"Masked(top={self.top!r}): give True (sentinels at the top of the "
                                   "range) or False (at the bottom).")

    @property
    def needs_histogram(self) -> bool:
        return self.method.needs_histogram

    def to_dict(self) -> dict[str, Any]:
        out = {"method": self.name, "inner": self.method.to_dict(), "sentinel": self.sentinel}
        return {**out, "top": True} if self.top else out

    def _range(self, stats: Statistics, qtype: QType, symmetric: bool) -> _Range:
        lo, hi = self.method._range(stats, qtype, symmetric)
        lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
        pad = qtype.bits * math.log(2.0) + 1.0
        degenerate = np.all(hi - lo <= 1e-6 * np.maximum(1.0, np.abs(hi)))
        if self.top:
            return lo, (lo + 64.0 if degenerate else hi + pad)
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
    that is read. The inner method calibrates the rest. A batch in which most
    values reach the cap is observed whole: there the cap does not single out
    a few rows.
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
