"""Per-channel ranges of the quantized weights, with outlier channels flagged (internal).

For every weight the plan quantizes (`Plan.weight_specs`), the min, max and
abs max of each channel: along the spec's channel axis, or along the weight's
output channels when the spec is per tensor. Public names are re-exported by
`odmlq.report`.

The outlier rule: a channel is an outlier when its abs max is more than
`OUTLIER_RATIO` (4) times the median channel's. Under one per-tensor scale,
set by the largest channel, the median channel then uses under a quarter of
the levels: two bits of an int8 weight lost to one channel. Per-channel
weights are flagged too (their own scales absorb the outlier, but a
per-tensor scheme, or an input scale shared with them, would not).

The collapse rule: a scale's cell (a block, a channel, or the whole tensor)
is collapsed when more than `COLLAPSED_FRACTION` (half) of its nonzero
weights round to code 0 at that scale: one large weight sets the cell's
scale and the rest of the cell vanishes (an int4 model that passes a smoke
test and answers garbage). Rounded to nearest at the weights' `Scales`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from odmlq.scales import flat_params

OUTLIER_RATIO = 4.0
COLLAPSED_FRACTION = 0.5


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightRange:
    """The per-channel range of one quantized weight.

    Attributes:
      param: the parameter path (``'conv1/kernel'``).
      module_path: the module of the (first) op that reads it.
      spec: its quantization, as the plan prints it.
      axis: the channel axis of the parameter (None: the whole tensor is one channel).
      min, max: per channel.
      outliers: channels whose abs max exceeds `OUTLIER_RATIO` x the median channel's.
      levels: positive integer levels of its qtype (127 for narrow int8;
        None for fp8 / nf4).
      median_levels: per-tensor integer weights only: how many of `levels`
        the median channel's abs max reaches under the tensor's one scale.
      cells: the weight's scale cells (blocks x channels, channels, or 1);
        0 where it was not checked (no integer scale known).
      collapsed: flat indices (in the scale's shape, row-major) of the cells
        where over half of the nonzero weights round to 0.
    """

    param: str
    module_path: str
    spec: str
    axis: int | None
    min: tuple[float, ...]
    max: tuple[float, ...]
    outliers: tuple[int, ...]
    levels: int | None = None
    median_levels: float | None = None
    cells: int = 0
    collapsed: tuple[int, ...] = ()

    @property
    def absmax(self) -> np.ndarray:
        return np.maximum(np.abs(np.asarray(self.min)), np.abs(np.asarray(self.max)))

    @property
    def outlier_ratio(self) -> float:
        """The largest channel's abs max over the median channel's (inf for a zero median)."""
        absmax = self.absmax
        median = float(np.median(absmax)) if absmax.size else 0.0
        return float(np.max(absmax, initial=0.0)) / median if median > 0 else float("inf")

    def to_dict(self) -> dict:
        return {"param": self.param, "module_path": self.module_path, "spec": self.spec,
                "axis": self.axis, "min": list(self.min), "max": list(self.max),
                "outliers": list(self.outliers), "levels": self.levels,
                "median_levels": self.median_levels, "cells": self.cells,
                "collapsed": list(self.collapsed)}

    @classmethod
    def from_dict(cls, d: dict) -> "WeightRange":
        return cls(param=d["param"], module_path=d["module_path"], spec=d["spec"], axis=d["axis"],
                   min=tuple(float(v) for v in d["min"]), max=tuple(float(v) for v in d["max"]),
                   outliers=tuple(int(c) for c in d["outliers"]), levels=d.get("levels"),
                   median_levels=d.get("median_levels"), cells=int(d.get("cells", 0)),
                   collapsed=tuple(int(c) for c in d.get("collapsed", ())))


def _operands(plan) -> dict[str, tuple]:
    """Parameter path -> (op, operand) of the first op that reads it as a weight."""
    out = {}
    for op in plan.graph.ops:
        for operand in op.weights:
            out.setdefault(operand.param, (op, operand))
    return out


def _channel_axis(spec, operand, ndim: int) -> int | None:
    stacked = set(operand.stacked_axes)
    own = [a for a in spec.scale_axes if a not in stacked]
    if len(own) == 1:
        return own[0]
    channels = [a for a in (operand.channel_axes or ()) if a not in stacked]
    return channels[-1] % ndim if channels else None


def weight_ranges(plan, params, scales=None) -> tuple[WeightRange, ...]:
    """The per-channel range of every weight `plan` quantizes, in parameter order.

    Args:
      plan: the Plan.
      params: the float params (Linen variables, an NNX module, ...).
      scales: the `Scales` the weights are quantized with (for
        `median_levels`; computed from the values when absent).
    """
    values = flat_params(params)
    operands = _operands(plan)
    out = []
    for param, spec in plan.weight_specs().items():
        if param not in values or param not in operands:
            continue
        x = np.asarray(values[param], np.float64)
        op, operand = operands[param]
        axis = _channel_axis(spec, operand, x.ndim)
        if axis is None:
            lo, hi = np.min(x, keepdims=True).reshape(1), np.max(x, keepdims=True).reshape(1)
        else:
            rest = tuple(a for a in range(x.ndim) if a != axis)
            lo, hi = np.min(x, axis=rest), np.max(x, axis=rest)
        absmax = np.maximum(np.abs(lo), np.abs(hi))
        median = float(np.median(absmax))
        outliers = tuple(int(c) for c in np.flatnonzero(absmax > OUTLIER_RATIO * median)) if median > 0 else ()
        qt = spec.qtype
        levels = median_levels = None
        if qt.kind == "int":
            levels = int(qt.qmax)
            if not spec.scale_axes and spec.block_size is None:
                ts = None if scales is None else scales.weights.get(param)
                step = (float(np.max(np.asarray(ts.scale))) if ts is not None
                        else float(np.max(absmax)) / levels)
                median_levels = round(median / step, 1) if step > 0 else 0.0
        ts = None if scales is None or op.attributes.get("fold") else scales.weights.get(param)
        cells, collapsed = _collapsed(values[param], ts) if ts is not None and qt.kind == "int" else (0, ())
        out.append(WeightRange(param=param, module_path=op.module_path, spec=spec.describe(), axis=axis,
                               min=tuple(float(v) for v in lo), max=tuple(float(v) for v in hi),
                               outliers=outliers, levels=levels, median_levels=median_levels,
                               cells=cells, collapsed=collapsed))
    return tuple(out)


def _collapsed(value, ts) -> tuple[int, tuple[int, ...]]:
    """``(cells, collapsed cells)`` of a weight at its scale (see the module doc)."""
    x = np.asarray(value, np.float32)
    cells = ts.cells(x.shape)
    if cells is None:
        return 0, ()
    size = int(np.size(ts.scale))
    cell = cells.ravel()
    zero = np.asarray(ts.fake_quant(x)).ravel() == 0
    nonzero = x.ravel() != 0
    counted = np.bincount(cell[nonzero], minlength=size)
    vanished = np.bincount(cell[nonzero & zero], minlength=size)
    flagged = np.flatnonzero(vanished > COLLAPSED_FRACTION * np.maximum(counted, 1))
    return size, tuple(int(c) for c in flagged)
