"""compare: which edge lost accuracy, and whether it lost it itself or inherited it.

`compare(model, plan, scales, *inputs)` runs the model three ways on the same
inputs and lines the runs up edge by edge (by plan edge id):

- float: the model as it is;
- simulate: every edge and weight quantized as the plan says (error the edge
  *carries*: what it introduced plus what reached it from upstream);
- local: each op fed the float values of its inputs, then quantized (the
  error the edge *introduces*: its own weights and output quantization);

and, given a .tflite, the LiteRT interpreter's tensors (mapped to edges as
verification maps them). Edges are ranked by their local SQNR, worst first:
the top of the table is where accuracy is lost, not where it is noticed.

Example:
  >>> report = odmlq.compare(model, plan, scales, x_test[:64], variables=variables)
  >>> print(report)           # worst edges first
  >>> report.to_json()
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from odmlq._model_run import GraphCache, params_for
from odmlq._plan_table import table
from odmlq.qtypes import qtype as lookup_qtype

__all__ = ["EdgeMetrics", "Report", "compare", "edge_metrics"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EdgeMetrics:
    """How far a run's tensor is from float at one edge.

    SQNR is 10 log10(|float|^2 / |error|^2) in dB (inf for no error); `lsb` is
    the largest error in steps of the edge's scale; `clipped` the share of
    float values outside the edge's representable range; `nan` the number of
    non-finite values in the run (reported, not turned into a huge error).
    """

    sqnr_db: float
    cosine: float
    max_abs: float
    mean_abs: float
    lsb: float | None
    clipped: float | None
    nan: int = 0

    def to_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isinf(v) else v)
                for k, v in dataclasses.asdict(self).items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class EdgeReport:
    edge: str
    op: str | None
    module_path: str
    spec: str
    runs: dict[str, EdgeMetrics]  # 'simulate', 'local', 'litert' -> metrics vs float

    @property
    def local_sqnr_db(self) -> float:
        return self.runs["local"].sqnr_db if "local" in self.runs else math.inf


@dataclasses.dataclass(frozen=True, kw_only=True)
class Report:
    """Per-edge metrics of every run against float, worst local SQNR first."""

    edges: tuple[EdgeReport, ...]
    outputs: dict[str, EdgeMetrics]
    unmapped_tensors: tuple[str, ...] = ()

    def worst(self, n: int = 5) -> tuple[EdgeReport, ...]:
        return self.edges[:n]

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps({
            "format": "odmlq.report", "version": 1,
            "edges": [{"edge": e.edge, "op": e.op, "module_path": e.module_path, "spec": e.spec,
                       "runs": {k: m.to_dict() for k, m in e.runs.items()}} for e in self.edges],
            "outputs": {k: m.to_dict() for k, m in self.outputs.items()},
            "unmapped_tensors": list(self.unmapped_tensors),
        }, indent=indent)

    def __str__(self) -> str:
        runs = [r for r in ("local", "simulate", "litert") if any(r in e.runs for e in self.edges)]
        headers = ["edge", "module", "spec"] + [f"{r} dB" for r in runs] + ["max LSB", "clipped", "who"]
        rows = []
        for e in self.edges:
            sim = e.runs.get("simulate")
            cells = [e.edge, e.module_path or "''", e.spec]
            cells += [_db(e.runs[r].sqnr_db) if r in e.runs else "-" for r in runs]
            cells += [f"{sim.lsb:.1f}" if sim and sim.lsb is not None else "-",
                      f"{100 * sim.clipped:.2f}%" if sim and sim.clipped is not None else "-",
                      _who(e)]
            rows.append(cells)
        lines = ["Edges, worst local SQNR first (local: this op on float inputs; simulate: "
                 "everything quantized; vs float)", table(headers, rows)]
        out = [f"{k}: {_db(m.sqnr_db)} dB" for k, m in self.outputs.items()]
        lines.append("outputs vs float: " + ", ".join(out))
        if self.unmapped_tensors:
            lines.append("LiteRT tensors with no plan edge: " + ", ".join(self.unmapped_tensors))
        return "\n".join(lines)


def _db(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.1f}"


def _who(e: EdgeReport) -> str:
    """'local' when the edge introduces most of its error, else 'inherited'."""
    local, total = e.runs.get("local"), e.runs.get("simulate")
    if local is None or total is None or math.isinf(total.sqnr_db):
        return "-"
    # Error powers add (roughly): local noise vs the total noise at this edge.
    local_noise = 10 ** (-local.sqnr_db / 10) if not math.isinf(local.sqnr_db) else 0.0
    total_noise = 10 ** (-total.sqnr_db / 10)
    return "local" if local_noise >= 0.5 * total_noise else "inherited"


def edge_metrics(reference: np.ndarray, value: np.ndarray, scale=None) -> EdgeMetrics:
    """Metrics of `value` against `reference` (float), with LSBs of `scale`'s TensorScale."""
    ref = np.asarray(reference, np.float64)
    val = np.asarray(value, np.float64)
    finite = np.isfinite(val)
    nan = int(val.size - np.count_nonzero(finite))
    err = np.where(finite, val - ref, 0.0)
    signal, noise = float(np.sum(ref ** 2)), float(np.sum(err ** 2))
    sqnr = math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf)
    norms = float(np.linalg.norm(ref) * np.linalg.norm(np.where(finite, val, 0.0)))
    cosine = float(np.sum(ref * np.where(finite, val, 0.0)) / norms) if norms > 0 else 1.0
    lsb = clipped = None
    if scale is not None:
        s = np.asarray(scale.scale, np.float64)
        lsb = float(np.max(np.abs(err) / s)) if err.size else 0.0
        qt = lookup_qtype(scale.qtype)
        zp = 0.0 if scale.zero_point is None else np.asarray(scale.zero_point, np.float64)
        qmin = qt.qmin + (1 if scale.narrow_range else 0)
        lo, hi = (qmin - zp) * s, (qt.qmax - zp) * s
        clipped = float(np.mean((ref < lo - s / 2) | (ref > hi + s / 2)))
    return EdgeMetrics(sqnr_db=sqnr, cosine=cosine, max_abs=float(np.max(np.abs(err), initial=0.0)),
                       mean_abs=float(np.mean(np.abs(err))) if err.size else 0.0, lsb=lsb,
                       clipped=clipped, nan=nan)


def compare(model: Any, plan, scales, *inputs: Any, variables: Any = None,
            tflite: bytes | None = None) -> Report:
    """Lines up float, simulate, local and (optionally) LiteRT runs edge by edge.

    Args:
      model, plan, scales, variables: the quantized model (see `simulate`).
      *inputs: a batch of inputs (for LiteRT, split into the model's batch size).
      tflite: an exported model to add as the 'litert' run.

    Returns:
      A `Report`, edges ranked by local SQNR (worst first).
    """
    from odmlq.simulate import Simulator

    params = params_for(model, variables, "compare")
    graph = GraphCache(model, plan, variables).graph_for(inputs)
    floats: dict[str, Any] = {}
    float_out = graph.evaluate(params, *inputs, on_edge=lambda e, x: floats.setdefault(e, x))
    floats = {k: np.asarray(v) for k, v in floats.items()}
    simulator = Simulator(model, plan, scales, variables=variables)
    sim_out, simulated = simulator(*inputs, capture=True)
    _, local = simulator(*inputs, capture=True, feed=floats)
    litert, unmapped = (_litert_edges(tflite, plan, scales, inputs) if tflite is not None else ({}, ()))
    reports = []
    for edge_id, edge_plan in plan.edges.items():
        if edge_id not in floats or plan.graph.edges[edge_id].alias:
            continue
        ts = scales.edges.get(edge_id)
        runs = {"simulate": edge_metrics(floats[edge_id], simulated[edge_id], ts),
                "local": edge_metrics(floats[edge_id], local[edge_id], ts)}
        if edge_id in litert:
            runs["litert"] = edge_metrics(floats[edge_id], litert[edge_id], ts)
        producer = plan.graph.edges[edge_id].producer
        reports.append(EdgeReport(
            edge=edge_id, op=producer,
            module_path=plan.graph.op(producer).module_path if producer else "",
            spec=edge_plan.spec.describe() if edge_plan.spec else "float", runs=runs))
    reports.sort(key=lambda e: (e.local_sqnr_db, e.runs["simulate"].sqnr_db))
    import jax

    outputs = {f"output_{i}": edge_metrics(f, s) for i, (f, s) in
               enumerate(zip(jax.tree_util.tree_leaves(float_out), jax.tree_util.tree_leaves(sim_out)))}
    return Report(edges=tuple(reports), outputs=outputs, unmapped_tensors=tuple(unmapped))


def _litert_edges(tflite: bytes, plan, scales, inputs: Sequence) -> tuple[dict, tuple]:
    """LiteRT's dequantized tensors per edge, the batch stitched back together."""
    import warnings

    from ai_edge_litert.interpreter import Interpreter

    from odmlq.litert.verify import _dequantize, _rows, _to_input, map_tensors

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        interpreter = Interpreter(model_content=bytes(tflite), experimental_preserve_all_tensors=True)
    interpreter.allocate_tensors()
    details = {d["index"]: d for d in interpreter.get_tensor_details()}
    produced = {int(t) for op in interpreter._get_ops_details() for t in op["outputs"]}
    mapping = map_tensors(list(details.values()), produced, plan, scales)
    values: dict[str, list] = {e: [] for e in mapping}
    for row in _rows([tuple(inputs)], interpreter):
        for d, x in zip(interpreter.get_input_details(), row):
            interpreter.set_tensor(d["index"], _to_input(x, d))
        interpreter.invoke()
        for e, i in mapping.items():
            values[e].append(_dequantize(interpreter.get_tensor(i), details[i]))
    unmapped = tuple(details[i]["name"] for i in sorted(produced)
                     if i not in mapping.values() and details[i]["dtype"] in (np.int8, np.int16))
    return {e: np.concatenate(v) for e, v in values.items() if v}, unmapped
