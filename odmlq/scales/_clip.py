"""Weight ranges searched against the calibration inputs (`GPTQ(clip_search=True)`).

Internal; `compute_scales` calls `clip_searched` before the weights are rounded.

Each scale cell of a weight (a block, an output channel, or the whole
tensor) starts at its abs max. Clipping it shrinks the step of every other
weight in the cell, at the cost of the largest ones; which wins depends on
the inputs the weights multiply. For ratios of the abs max from 1 down to
`LOWEST`, the cell's output error on the calibration inputs is
``d^T H d`` (``d``: the weights minus their rounded values, ``H``: the input
second moment the calibration collected for GPTQ, restricted to the cell's
own inputs for a block), and each cell keeps the ratio with the least error
(AWQ's clip search: Lin et al., "AWQ: Activation-aware Weight Quantization
for LLM Compression and Acceleration", MLSys 2024). Ratio 1 is a candidate,
so no cell's error grows. Symmetric integer weights only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from odmlq.scales._tensor import TensorScale, stored_scale

__all__ = ["clip_searched", "LOWEST", "STEPS"]

LOWEST = 0.6
STEPS = 17  # 1.0, 0.975, ..., 0.6


def clip_searched(plan, weights: Mapping[str, TensorScale], values: Mapping[str, Any],
                  calibration) -> dict[str, TensorScale]:
    """`weights` with the range of every weight whose algorithm asks for a clip
    search (and whose inputs the calibration observed) searched."""
    out = dict(weights)
    for param, spec in plan.weight_specs().items():
        ts = weights.get(param)
        if (not getattr(spec.algorithm, "clip_search", False) or ts is None or calibration is None
                or param not in calibration.grams or ts.zero_point is not None or ts.qtype.kind != "int"):
            continue
        scale = searched_scale(np.asarray(values[param], np.float64), ts, calibration.grams[param],
                               getattr(spec, "scale_dtype", "float32"))
        if scale is not None:
            out[param] = dataclasses.replace(ts, scale=scale)
    return out


def searched_scale(w: np.ndarray, ts: TensorScale, gram, scale_dtype: str) -> np.ndarray | None:
    """The searched scale of one weight, in `ts.scale`'s shape (None where its
    cells are not laid out as the search reads them)."""
    layout = gram.layout
    base = np.asarray(ts.scale, np.float64)
    cells = ts.cells(w.shape)
    if cells is None:
        return None
    cells = layout.matrix(cells)  # (groups, outputs, taps)
    matrix = layout.matrix(w)
    h = gram.matrix.astype(np.float64)  # (groups, taps, taps)
    groups, outputs, taps = matrix.shape
    qmin, qmax = ts.qtype.range(ts.narrow_range)
    top = np.abs(matrix)
    if np.all(cells == cells[..., :1]):  # one cell per row (per channel or per tensor)
        block = taps
    else:  # cells in contiguous runs of taps: blocks along the contracted axis
        block = ts.block_size
        if ts.block_size is None or taps % block or np.any(
                cells.reshape(groups, outputs, taps // block, block) != cells[..., ::block][..., None]):
            return None
    nb = taps // block
    cell_of = cells[..., ::block]  # (groups, outputs, nb)
    absmax = top.reshape(groups, outputs, nb, block).max(axis=-1)
    cell_max = np.zeros(base.size)
    np.maximum.at(cell_max, cell_of.ravel(), absmax.ravel())
    wb = matrix.reshape(groups, outputs, nb, block)
    hb = np.stack([h[:, i * block:(i + 1) * block, i * block:(i + 1) * block] for i in range(nb)], axis=1)
    best = np.full(base.size, np.inf)
    chosen = np.asarray(stored_scale((cell_max / qmax).astype(np.float32), scale_dtype), np.float64)
    for ratio in np.linspace(1.0, LOWEST, STEPS):
        candidate = np.asarray(stored_scale((ratio * cell_max / qmax).astype(np.float32), scale_dtype), np.float64)
        candidate = np.where(candidate > 0, candidate, 1.0)
        step = candidate[cell_of][..., None]
        d = wb - np.clip(np.round(wb / step), qmin, qmax) * step
        by_block = np.transpose(d, (0, 2, 1, 3))  # (groups, blocks, outputs, block): one BLAS matmul a block
        error = np.transpose(np.sum((by_block @ hb) * by_block, axis=-1), (0, 2, 1))
        per_cell = np.bincount(cell_of.ravel(), weights=error.ravel(), minlength=base.size)
        better = per_cell < best
        best = np.where(better, per_cell, best)
        chosen = np.where(better, candidate, chosen)
    return chosen.reshape(base.shape).astype(np.float32)
