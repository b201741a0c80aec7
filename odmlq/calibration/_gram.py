"""Gram: the second moment of what multiplies one weight, streamed over the
calibration data (what `odmlq.GPTQ` rounds against).

For a weight read by a matmul, the rows of its input; for a convolution,
every input patch its window covers (`odmlq.graph.weight_inputs`). Summed
outer products and a row count merge exactly across batches and processes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from odmlq.errors import CalibrationError
from odmlq.graph import WeightLayout

__all__ = ["Gram"]


@dataclasses.dataclass(frozen=True, eq=False)
class Gram:
    """Summed outer products of a weight's inputs.

    Attributes:
      matrix: ``(groups, taps, taps)`` float64, ``sum over rows of p p^T``.
      rows: how many input rows (output positions, batch included) were summed.
      layout: how the weight is laid out against the taps (`WeightLayout`).
      fourth: ``(groups,)``, ``sum over rows of |p|^4``: how far each row's
        outer product strays from the mean, which says how much of `matrix`
        is sampling noise (`shrinkage`).
      total: ``(groups, taps)``, ``sum over rows of p`` (the mean patch, times
        `rows`, for bias correction); None in statistics saved without it.
    """

    matrix: np.ndarray
    rows: int
    layout: WeightLayout
    fourth: np.ndarray
    total: np.ndarray | None = None

    def shrinkage(self) -> np.ndarray:
        """``(groups,)`` Ledoit-Wolf shrinkage intensities in [0, 1]: the weight
        that the mean second moment ``S = matrix / rows`` is best mixed with
        ``mean(diag S) I`` in a well-conditioned estimate of the inputs' true
        second moment. Near 1 where few rows were seen for many taps.

        References:
          Ledoit, Wolf. "A well-conditioned estimator for large-dimensional
          covariance matrices", J. Multivariate Analysis 88 (2004).
        """
        s = self.matrix / self.rows
        mu = np.trace(s, axis1=1, axis2=2) / s.shape[1]
        frobenius = np.sum(s * s, axis=(1, 2))
        spread = frobenius - 2 * mu * np.trace(s, axis1=1, axis2=2) + mu * mu * s.shape[1]
        noise = np.maximum(self.fourth / self.rows ** 2 - frobenius / self.rows, 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            rho = np.where(spread > 0, noise / spread, 1.0)
        return np.clip(rho, 0.0, 1.0)

    def merged(self, other: "Gram", where: str) -> "Gram":
        if other.layout != self.layout or other.matrix.shape != self.matrix.shape:
            raise CalibrationError(
                f"{where}: the weight's inputs were observed with two layouts ({self.layout} and "
                f"{other.layout}); calibrate one plan of one model.")
        total = None if self.total is None or other.total is None else self.total + other.total
        return Gram(self.matrix + other.matrix, self.rows + other.rows, self.layout, self.fourth + other.fourth,
                    total)

    def metadata(self) -> dict[str, Any]:
        out = {"rows": self.rows, "layout": self.layout.to_dict(), "fourth": self.fourth.tolist()}
        if self.total is not None:
            out["total"] = self.total.tolist()
        return out

    @classmethod
    def from_parts(cls, metadata: Any, matrix: Any, where: str) -> "Gram":
        """A Gram from stored metadata and matrix, checked."""
        try:
            layout = WeightLayout.from_dict(metadata["layout"])
            rows = metadata["rows"]
            fourth = np.asarray(metadata["fourth"], np.float64)
            total = metadata.get("total")
            total = None if total is None else np.asarray(total, np.float64)
            matrix = np.asarray(matrix, np.float64)
        except (KeyError, TypeError, ValueError) as e:
            raise CalibrationError(f"{where}: unreadable input statistics ({type(e).__name__}: {e}).") from e
        if (type(rows) is not int or rows < 1 or matrix.ndim != 3 or matrix.shape[1] != matrix.shape[2]
                or matrix.shape[0] != layout.groups or fourth.shape != (layout.groups,)
                or not np.all(np.isfinite(matrix)) or not np.all(np.isfinite(fourth))
                or (total is not None and (total.shape != matrix.shape[:2] or not np.all(np.isfinite(total))))):
            raise CalibrationError(
                f"{where}: the input statistics are inconsistent (rows {rows!r}, matrix of shape "
                f"{matrix.shape} for {layout.groups} group(s)); write them with Calibration.save.")
        return cls(matrix, rows, layout, fourth, total)
