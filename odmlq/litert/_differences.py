"""How far a float tensor of an exported model is from simulate (internal; used by `verify`).

A float edge (a dynamic-range or weight-only export's) is compared relative to
the largest finite value of its op's output or inputs, infinities where they are.
"""

from __future__ import annotations

import numpy as np


def magnitude(plan, edge_id: str, value: np.ndarray, fed: dict) -> float:
    """The largest finite magnitude among a float edge's values and its producer's activation
    inputs (a mask's -inf would make every other difference relative to infinity, zero)."""
    largest = _largest_finite(value)
    producer = plan.graph.edges[edge_id].producer
    for operand in () if producer is None else plan.graph.op(producer).operands:
        source = None if operand.edge is None else fed.get(plan.graph.resolve(operand.edge), fed.get(operand.edge))
        if operand.role == "input" and source is not None and np.size(source):
            largest = max(largest, _largest_finite(np.asarray(source, np.float64)))
    return max(largest, 1e-30)


def _largest_finite(value: np.ndarray) -> float:
    finite = np.abs(value[np.isfinite(value)]) if np.size(value) else np.zeros(0)
    return float(finite.max()) if finite.size else 0.0


def relative_difference(want: np.ndarray, got: np.ndarray, largest: float) -> np.ndarray:
    """|want - got| / largest, element by element, where the same infinity (a `where`'s -inf
    mask) or NaN in both is no difference and a non-finite value in only one is an infinite
    one: NaN compares as no number, and a NaN maximum would pass any tolerance.

    litert-converter writes a constant's infinity as float32's largest finite value
    (measured: `jnp.where(mask, scores, -jnp.inf)` selects -3.4028235e38), which every
    reader (softmax, max, a comparison) treats as the infinity it stands for."""
    with np.errstate(invalid="ignore"):
        difference = np.abs(want - got) / largest
    saturated = np.isinf(want) & (np.abs(got) >= _FLOAT32_MAX) & (np.sign(want) == np.sign(got))
    same = (want == got) | (np.isnan(want) & np.isnan(got)) | saturated
    return np.where(same, 0.0, np.where(np.isfinite(difference), difference, np.inf))


_FLOAT32_MAX = float(np.finfo(np.float32).max)
