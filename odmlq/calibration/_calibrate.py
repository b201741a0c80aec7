"""calibrate: stream a representative dataset through a planned model."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from odmlq.graph import GraphCache, check_finite_params, check_inputs, params_for
from odmlq.calibration._calibration import Calibration
from odmlq.errors import CalibrationError

__all__ = ["calibrate"]


def calibrate(model: Any, plan, rep_dataset: Iterable | Callable[[], Iterable], *,
              variables: Any = None, progress: bool | None = None,
              calibration: Calibration | None = None) -> Calibration:
    """Collects statistics of every statically quantized edge of `plan`.

    Args:
      model: the model the plan was made from (Linen: pass `variables`).
      plan: the Plan; each edge is observed with its spec's calibration method.
      rep_dataset: an iterable of batches, or a callable returning one. A batch
        is an array (one model input) or a tuple of arrays, numpy or jax, of
        the example inputs' shapes and dtypes (any batch size).
      progress: print a progress line on stderr (default: when stderr is a tty).
      calibration: statistics to add to (merging runs).

    Returns:
      A `Calibration` keyed by edge id; `save()` it to reuse.

    Raises:
      CalibrationError: no batches; a batch with NaN or Inf (names the batch
        index and input); a batch of the wrong shape or dtype.

    Example:
      >>> calibration = odmlq.calibrate(model, plan, [x[i:i + 32] for i in range(0, 320, 32)],
      ...                               variables=variables)
    """
    params = params_for(model, variables, "calibrate")
    check_finite_params(params)
    cache = GraphCache(model, plan, variables)
    edges = {e: p.spec for e, p in plan.edges.items()
             if p.spec is not None and not p.spec.dynamic and plan.graph.edges[e].alias is None}
    for conversion in plan.conversions.values():
        # A float edge read by an integer op (after a float island) is
        # quantized where it is read: its range is calibrated too.
        edges.setdefault(conversion.edge, conversion.spec)
    out = Calibration() if calibration is None else calibration
    dataset = rep_dataset() if callable(rep_dataset) else rep_dataset
    total = len(dataset) if hasattr(dataset, "__len__") else None
    show = sys.stderr.isatty() if progress is None else progress
    collectors: dict[Any, Callable] = {}
    count = 0
    for index, batch in enumerate(dataset):
        inputs = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        check_inputs(plan.graph, inputs, f"rep_dataset batch {index}")
        _check_finite(inputs, index)
        graph = cache.graph_for(inputs)
        key = id(graph)
        if key not in collectors:
            collectors[key] = jax.jit(_collector(graph, edges))
        values = collectors[key](params, *inputs)
        for edge_id, value in values.items():
            out.observe(edge_id, edges[edge_id].calibration, np.asarray(value),
                        keep_axes=edges[edge_id].scale_axes, batch_index=index)
        count += 1
        if show:
            print(f"\rcalibrating: batch {count}" + (f"/{total}" if total else ""),
                  end="", file=sys.stderr, flush=True)
    if show:
        print(file=sys.stderr)
    if count == 0:
        raise CalibrationError(
            "rep_dataset yielded no batches; give an iterable of input batches (or a callable "
            "returning one), e.g. [x_calibration[i:i + 32] for i in range(0, len(x_calibration), 32)]."
        )
    return out


def _collector(graph, edges):
    def collect(params, *inputs):
        seen = {}

        def on_edge(edge_id, x):
            if edge_id in edges:
                seen[edge_id] = x
            return x

        graph.evaluate(params, *inputs, on_edge=on_edge)
        return seen

    return collect


def _check_finite(inputs: tuple, index: int) -> None:
    for i, x in enumerate(jax.tree_util.tree_leaves(inputs)):
        x = np.asarray(x)
        if np.issubdtype(x.dtype, np.floating):
            bad = int(np.size(x) - np.count_nonzero(np.isfinite(x)))
            if bad:
                raise CalibrationError(
                    f"rep_dataset batch {index}, input {i}: {bad} NaN or Inf value(s); clean the "
                    "representative data (calibration ranges would be meaningless)."
                )
