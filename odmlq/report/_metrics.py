"""How far one run's tensor is from float: the numbers behind each report cell (internal).

`edge_metrics(reference, value, scale)` gives SQNR, cosine, absolute error,
the largest error in LSBs of the edge's scale, the share of float values the
edge's range clips, non-finite values, and a histogram of the error
(`ErrorHistogram`). Public names are re-exported by `odmlq.report`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


HISTOGRAM_BINS = 41  # odd: one bin centred on zero error
_HALF = HISTOGRAM_BINS // 2
# JSON has no -Infinity: an SQNR of -inf (float all zeros, the run not) is written as this.
MINUS_INF_DB = -999.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ErrorHistogram:
    """Counts of (run - float) errors in `HISTOGRAM_BINS` equal bins over [lo, hi].

    The bins are symmetric around zero, the middle one centred on it. With a
    scale (`unit` 'LSB') a bin is a whole number of the edge's quantization
    steps wide (1 when every error is within 20 LSB), so bin ``k`` from the
    middle holds errors of about ``k * width`` steps; without one (`unit`
    'abs', a float edge or an output) the range is the largest error.
    [lo, hi] covers every finite error; non-finite values are not counted.
    """

    lo: float
    hi: float
    unit: str
    counts: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"lo": self.lo, "hi": self.hi, "unit": self.unit, "counts": list(self.counts)}

    @classmethod
    def from_dict(cls, d: dict) -> "ErrorHistogram":
        return cls(lo=float(d["lo"]), hi=float(d["hi"]), unit=str(d["unit"]),
                   counts=tuple(int(c) for c in d["counts"]))


def error_histogram(err: np.ndarray, steps: np.ndarray | None) -> ErrorHistogram:
    """The histogram of finite errors `err`, in steps of `steps` (broadcast) when given."""
    if steps is not None:
        units, name = err / steps, "LSB"
        largest = float(np.max(np.abs(units), initial=0.0))
        width = float(max(1, math.ceil((largest - 0.5) / _HALF - 1e-9)))
    else:
        units, name = err, "abs"
        largest = float(np.max(np.abs(units), initial=0.0))
        width = largest / _HALF if largest > 0 else 1.0
    hi = (_HALF + 0.5) * width
    index = np.clip(np.floor(units.reshape(-1) / width + _HALF + 0.5), 0, HISTOGRAM_BINS - 1)
    counts = np.bincount(index.astype(np.int64), minlength=HISTOGRAM_BINS)
    return ErrorHistogram(lo=-hi, hi=hi, unit=name, counts=tuple(int(c) for c in counts))


@dataclasses.dataclass(frozen=True, kw_only=True)
class EdgeMetrics:
    """How far a run's tensor is from float at one edge.

    Attributes:
      sqnr_db: 10 log10(|float|^2 / |error|^2) in dB; inf for no error.
      cosine: cosine similarity with float.
      max_abs, mean_abs: largest and mean absolute error.
      lsb: the largest error in steps of the edge's scale (None: float edge).
      clipped: the share of float values outside the edge's representable
        range (None: float edge).
      nan: non-finite values in the run, reported rather than turned into a
        huge error (they are left out of every other number).
      simulate_lsb: for a backend run (xla, litert, device), the largest
        difference from `simulate` in steps of the edge's scale: 1 LSB is
        kernel rounding, more is a backend that computes something else.
      hist: the error histogram.
    """

    sqnr_db: float
    cosine: float
    max_abs: float
    mean_abs: float
    lsb: float | None
    clipped: float | None
    nan: int = 0
    simulate_lsb: float | None = None
    hist: ErrorHistogram | None = None

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "hist"}
        if math.isinf(self.sqnr_db):
            d["sqnr_db"] = None if self.sqnr_db > 0 else MINUS_INF_DB
        d["hist"] = None if self.hist is None else self.hist.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EdgeMetrics":
        d = dict(d)
        d["sqnr_db"] = math.inf if d.get("sqnr_db") is None else float(d["sqnr_db"])
        d["hist"] = None if d.get("hist") is None else ErrorHistogram.from_dict(d["hist"])
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _steps(scale, shape: tuple[int, ...]) -> np.ndarray:
    """The edge's scale broadcast to a tensor of `shape` (a per-channel scale
    laid out for another batch size falls back to its smallest step)."""
    s = np.asarray(scale.scale, np.float64)
    try:
        return np.broadcast_to(s, shape)
    except ValueError:
        return np.full(shape, float(np.min(s)))


def edge_metrics(reference: np.ndarray, value: np.ndarray, scale=None,
                 simulate: np.ndarray | None = None, masked_from: float | None = None) -> EdgeMetrics:
    """Metrics of `value` against `reference` (float).

    Args:
      reference: the float run's tensor.
      value: the run's tensor (same shape).
      scale: the edge's `TensorScale`, for LSB, clipping and an LSB histogram.
      simulate: simulate's tensor at this edge, for `simulate_lsb` (needs `scale`).
      masked_from: leave out the positions where the reference's magnitude
        is at least this (an attention mask's sentinel, which a `Masked`
        range places at its bottom on purpose).
    """
    ref = np.asarray(reference, np.float64)
    val = np.asarray(value, np.float64)
    if masked_from is not None:
        keep = np.abs(ref) < masked_from
        if not keep.all():
            ref, val = ref[keep], val[keep]
            simulate = None if simulate is None else np.asarray(simulate)[keep]
            if scale is not None and np.size(scale.scale) > 1:
                scale = None  # per-channel steps no longer line up with the kept values

    finite = np.isfinite(val)
    nan = int(val.size - np.count_nonzero(finite))
    shown = np.where(finite, val, 0.0)
    err = np.where(finite, val - ref, 0.0)
    signal, noise = float(np.sum(ref ** 2)), float(np.sum(err ** 2))
    sqnr = math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf)
    norms = float(np.linalg.norm(ref) * np.linalg.norm(shown))
    cosine = float(np.sum(ref * shown) / norms) if norms > 0 else 1.0
    lsb = clipped = simulate_lsb = steps = None
    if scale is not None:
        steps = _steps(scale, err.shape)
        lsb = float(np.max(np.abs(err) / steps, initial=0.0))
        qt = scale.qtype
        s = np.asarray(scale.scale, np.float64)
        zp = 0.0 if scale.zero_point is None else np.asarray(scale.zero_point, np.float64)
        qmin = qt.qmin + (1 if scale.narrow_range else 0)
        lo, hi = (qmin - zp) * s, (qt.qmax - zp) * s
        clipped = float(np.mean((ref < lo - s / 2) | (ref > hi + s / 2))) if ref.size else 0.0
        if simulate is not None:
            sim = np.asarray(simulate, np.float64)
            apart = np.where(finite & np.isfinite(sim), np.abs(val - sim), 0.0)
            simulate_lsb = float(np.max(apart / steps, initial=0.0))
    return EdgeMetrics(sqnr_db=sqnr, cosine=cosine, max_abs=float(np.max(np.abs(err), initial=0.0)),
                       mean_abs=float(np.mean(np.abs(err))) if err.size else 0.0, lsb=lsb,
                       clipped=clipped, nan=nan, simulate_lsb=simulate_lsb,
                       hist=error_histogram(err[finite], None if steps is None else steps[finite]))
