"""GPTQ: round a weight column by column, moving each column's rounding error
onto the columns not yet rounded, weighted by how the data correlates them.

For one output row ``w`` of a matmul reading inputs ``x``, the error the
layer makes is ``(w - q) H (w - q)^T`` with ``H = E[x^T x]`` (the input's
second moment, `odmlq.calibration.Gram`). Round-to-nearest minimizes each
``|w_j - q_j|`` alone; GPTQ rounds column ``j``, then updates the columns after
it by the least-squares correction ``-(w_j - q_j) / Hinv[j, j] * Hinv[j, j+1:]``
(``Hinv``: the upper Cholesky factor of ``H^-1``), so the layer's output error
for the data's inputs is what is minimized, not each weight's.

Bias correction (optional): rounding leaves an output shift ``(q - w) E[x]``
on average; the calibration's mean input patch gives it, and the op's folded
bias takes it back (Nagel et al. 2019, "empirical" form, from the float
model's inputs).

Scales are fixed before rounding, from the original weight with the spec's
weight calibration (as `odmlq.compute_scales` gives them), so every value is
on its scale's grid: the backends quantize the result and get exactly GPTQ's
integers.

References:
  Frantar, Ashkboos, Hoefler, Alistarh. "GPTQ: Accurate Post-Training
  Quantization for Generative Pre-trained Transformers", ICLR 2023
  (arXiv:2210.17323): the lazy batched updates, the Cholesky form, dampening
  and activation order used here.
  Nagel, van Baalen, Blankevoort, Welling. "Data-Free Quantization Through
  Weight Equalization and Bias Correction", ICCV 2019 (arXiv:1906.04721):
  bias correction.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np

from odmlq.errors import CalibrationError, RuleError

__all__ = ["GPTQ", "gptq_round"]


@dataclasses.dataclass(frozen=True)
class GPTQ:
    """Weights rounded against the calibration data's inputs (GPTQ).

    Needs calibration data: `odmlq.calibrate` collects each such weight's
    input second moment (`odmlq.calibration.Gram`), and the weights are
    rounded where scales are computed, so the XLA model, the LiteRT export
    and `simulate` all read the same integers. Inputs are the float model's
    (one calibration pass), not those of the layers quantized before it.

    Args:
      damping: added to the second moment's diagonal, as a fraction of its
        mean (keeps the inverse stable where calibration saw few inputs, or
        inputs that are always zero).
      act_order: round the columns whose inputs carry the most energy first.
      block_size: columns updated together (speed only; results equal for any
        size up to rounding).
      required: without statistics of the weight's inputs (no calibration,
        or an op whose matmul GPTQ cannot read), raise; False: round that
        weight to nearest instead (odmlq's default).
      bias_correction: after rounding, subtract the output shift the
        rounding leaves on average, ``(q - w) E[x]`` per output channel
        (``E[x]``: the calibration inputs' mean patch), from the op's bias.
        Applies where the op's bias is folded (a BatchNorm after a
        convolution or matmul; `odmlq.scales.bias_corrections`); the
        depthwise convolutions of mobile CNNs, with 9 or 25 weights per
        channel, gain most.
      clip_search: before rounding, each scale cell's range (a block's, an
        output channel's) is its abs max times the ratio, from 1 down to 0.6,
        that leaves the least output error on the calibration inputs (AWQ's
        clip search, `odmlq.scales._clip`); symmetric integer weights, blocks
        along one contracted axis. Off by default.

    Example:
      >>> rules = [odmlq.Rule('.*', weight_qtype='int4', weight_granularity=odmlq.PerBlock(128),
      ...                     weight_algorithm=odmlq.GPTQ())]
    """

    name: ClassVar[str] = "gptq"
    damping: float = 0.01
    act_order: bool = True
    block_size: int = 128
    required: bool = True
    bias_correction: bool = False
    clip_search: bool = False

    def __post_init__(self):
        if isinstance(self.damping, bool) or not isinstance(self.damping, (int, float)) or not (
                0 < self.damping <= 10):
            raise RuleError(f"GPTQ(damping={self.damping!r}): give a fraction in (0, 10], e.g. 0.01.")
        for name in ("act_order", "required", "bias_correction", "clip_search"):
            if not isinstance(getattr(self, name), bool):
                raise RuleError(f"GPTQ({name}={getattr(self, name)!r}): give True or False.")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise RuleError(f"GPTQ(block_size={self.block_size!r}): give a positive int, e.g. 128.")
        object.__setattr__(self, "damping", float(self.damping))

    def to_dict(self) -> dict[str, Any]:
        return {"algorithm": self.name, "damping": self.damping, "act_order": self.act_order,
                "block_size": self.block_size, "required": self.required,
                "bias_correction": self.bias_correction, "clip_search": self.clip_search}


def gptq_round(w: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, qmin: float,
               qmax: float, gram: np.ndarray, algorithm: GPTQ, *, shrinkage: float = 0.0,
               where: str) -> np.ndarray:
    """One group's rows rounded by GPTQ.

    Args:
      w: ``(rows, columns)`` weights; `scale` and `zero_point` the same shape
        (each element's own, broadcast from per-tensor, per-channel or
        per-block scales).
      qmin, qmax: the integer codes allowed (narrow range applied).
      gram: ``(columns, columns)``: the inputs' summed outer products.
      shrinkage: how much of `gram` is sampling noise (`Gram.shrinkage`, in
        [0, 1]): the second moment is mixed with its mean diagonal that much
        (the damping is at least ``shrinkage / (1 - shrinkage)``), so that
        few calibration rows for many columns do not fit the weights to
        those rows alone (1: round to nearest).
      where: names the weight in errors.

    Returns:
      ``(rows, columns)`` float64 values, each ``(code - zero_point) * scale``.
    """
    w = np.array(w, np.float64)
    columns = w.shape[1]
    h = np.array(gram, np.float64)
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0  # inputs never seen: their columns round to nearest, alone
    order = np.argsort(-np.diag(h), kind="stable") if algorithm.act_order else np.arange(columns)
    w, s = w[:, order], np.asarray(scale, np.float64)[:, order]
    z = None if zero_point is None else np.asarray(zero_point, np.float64)[:, order]
    h = h[np.ix_(order, order)]
    damping = algorithm.damping if shrinkage <= 0 else max(
        algorithm.damping, shrinkage / max(1.0 - shrinkage, 1e-12))
    factor = _inverse_factor(h, damping, where)
    q = np.zeros_like(w)
    for start in range(0, columns, algorithm.block_size):
        stop = min(start + algorithm.block_size, columns)
        block, errors = w[:, start:stop].copy(), np.zeros((w.shape[0], stop - start))
        inverse = factor[start:stop, start:stop]
        for i in range(stop - start):
            j = start + i
            codes = np.round(block[:, i] / s[:, j]) + (0.0 if z is None else z[:, j])
            codes = np.clip(codes, qmin, qmax)
            q[:, j] = (codes - (0.0 if z is None else z[:, j])) * s[:, j]
            errors[:, i] = (block[:, i] - q[:, j]) / inverse[i, i]
            block[:, i:] -= np.outer(errors[:, i], inverse[i, i:])
        w[:, stop:] -= errors @ factor[start:stop, stop:]
    out = np.empty_like(q)
    out[:, order] = q
    return out


def _inverse_factor(h: np.ndarray, damping: float, where: str) -> np.ndarray:
    """The upper Cholesky factor of ``(h + damping * mean(diag) I)^-1``."""
    eye = np.eye(h.shape[0])
    mean = float(np.mean(np.diag(h)))
    for attempt in range(4 if np.all(np.isfinite(h)) else 0):
        try:
            lower = np.linalg.cholesky(h + damping * 10 ** attempt * mean * eye)
            inverse_lower = np.linalg.solve(lower, eye)
            return np.linalg.cholesky(inverse_lower.T @ inverse_lower).T
        except np.linalg.LinAlgError:
            continue
    raise CalibrationError(
        f"GPTQ for {where}: the inputs' second moment is not positive definite even with "
        f"damping {damping * 1000:g}; calibrate on more varied data, or raise GPTQ(damping=...).")
