"""compare: which edge lost accuracy, whether it lost it itself or inherited it, and what fixes it.

`compare(model, plan, scales, *inputs)` runs the model several ways on the
same inputs and lines the runs up edge by edge (by plan edge id):

- float: the model as it is;
- simulate: every edge and weight quantized as the plan says (error the edge
  *carries*: what it introduced plus what reached it from upstream);
- local: each op fed the float values of its inputs, then quantized (the
  error the edge *introduces*: its own weights and output quantization);
- xla: given ``xla=odmlq.ptq(...)``, every edge the XLA backend computes;
- litert: given a .tflite, the LiteRT interpreter's tensors (mapped to edges
  as verification maps them);
- device: given also a device dump of that .tflite's tensors, the device's.

Edges are ranked by their local SQNR, worst first: the top of the table is
where accuracy is lost, not where it is noticed. Edges that share one scale
(a max pool, reshape or transpose keeps its input's) rank together, the edge
whose range sets the scale first; the others' own error reads "shared". The report also holds each
quantized weight's per-channel range with outlier channels flagged
(`WeightRange`), and advice for the worst edges (`Advice`): rules to put
first, measured with ``try_fixes=True``.

JSON (`Report.to_json`, read back with `Report.from_json`) is the contract
with the HTML renderer: format ``odmlq.report`` version 2, documented in
`Report.to_json`.

Example:
  >>> report = odmlq.compare(model, plan, scales, x_test[:64], variables=variables)
  >>> print(report)           # worst edges first
  >>> report = odmlq.compare(model, plan, scales, x_test[:64], variables=variables,
  ...                        calibration=calibration, rep_dataset=batches, try_fixes=True)
  >>> report.advice[0].rule   # a Rule to put first, with its measured gain
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from odmlq.batches import leaves
from odmlq.report import _text as _report_text
from odmlq.report._advice import Advice, Measured
from odmlq.report._islands import FloatOp, float_ops
from odmlq.report._metrics import EdgeMetrics, ErrorHistogram, edge_metrics
from odmlq.report._weights import OUTLIER_RATIO, WeightRange
from odmlq.calibration import Masked
from odmlq.constraints import SameAsInput
from odmlq.errors import OdmlqError

__all__ = ["Advice", "EdgeMetrics", "EdgeReport", "ErrorHistogram", "Measured", "OUTLIER_RATIO",
           "Report", "ReportError", "RUNS", "WeightRange", "compare", "edge_metrics"]

FORMAT_VERSION = 2
# Every run, in the order reports list them; each is measured against float.
RUNS = ("local", "simulate", "xla", "litert", "device")


class ReportError(OdmlqError, ValueError):
    """A report cannot be read (not odmlq report JSON, or another version)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EdgeReport:
    """One edge: its metrics in every run (run name -> `EdgeMetrics` vs float).

    `index` is the edge's position in execution (graph) order.
    """

    edge: str
    op: str | None
    module_path: str
    spec: str
    runs: dict[str, EdgeMetrics]
    index: int = -1
    # The edge whose range sets this edge's scale (a max pool, reshape or
    # transpose keeps its input's scale); None when it has its own.
    scale_from: str | None = None
    # The outputs' SQNR (dB, lowest output) with only this edge quantized, and
    # its rise with only this edge in float: how much of the outputs' error
    # the edge causes (`compare(contributions=True)`; None when not measured).
    alone_sqnr_db: float | None = None
    float_gain_db: float | None = None

    @property
    def local_sqnr_db(self) -> float:
        return self.runs["local"].sqnr_db if "local" in self.runs else math.inf

    @property
    def who(self) -> str:
        """'local' when the edge introduces most of its error, 'inherited' when
        it mostly carries error from upstream, '-' when it cannot tell."""
        local, total = self.runs.get("local"), self.runs.get("simulate")
        if local is None or total is None or math.isinf(total.sqnr_db):
            return "-"
        # Error powers add (roughly): local noise vs the total noise at this edge.
        local_noise = 10 ** (-local.sqnr_db / 10) if not math.isinf(local.sqnr_db) else 0.0
        total_noise = 10 ** (-total.sqnr_db / 10)
        if local_noise < 0.5 * total_noise:
            return "inherited"
        # Its own error comes from a scale another edge's statistics set.
        return "local" if self.scale_from is None else "shared"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Report:
    """Per-edge metrics of every run against float (worst local SQNR first),
    the model's outputs, weight ranges, advice and notes."""

    edges: tuple[EdgeReport, ...]
    outputs: dict[str, EdgeMetrics]
    unmapped_tensors: tuple[str, ...] = ()
    weights: tuple[WeightRange, ...] = ()
    advice: tuple[Advice, ...] = ()
    notes: tuple[str, ...] = ()
    run_names: tuple[str, ...] = ()
    float_ops: tuple[FloatOp, ...] = ()

    @property
    def runs(self) -> tuple[str, ...]:
        """The runs present, in `RUNS` order."""
        if self.run_names:
            return self.run_names
        return tuple(r for r in RUNS if any(r in e.runs for e in self.edges))

    def worst(self, n: int = 5) -> tuple[EdgeReport, ...]:
        return self.edges[:n]

    def contributors(self, n: int = 5) -> tuple[EdgeReport, ...]:
        """The `n` edges whose quantization costs the outputs most: lowest
        `EdgeReport.alone_sqnr_db` first, then largest `float_gain_db` (none
        without contributions)."""
        measured = [e for e in self.edges if e.alone_sqnr_db is not None]
        return tuple(sorted(measured, key=lambda e: (e.alone_sqnr_db, -e.float_gain_db))[:n])

    def to_dict(self) -> dict:
        """The JSON contract (version 2)::

          {"format": "odmlq.report", "version": 2, "runs": [run, ...],
           "edges": [{"edge", "op", "module_path", "spec", "index", "who",
                      "scale_from": edge | null,              # whose range sets its scale
                      "alone_sqnr_db": dB | null,             # outputs with only it quantized
                      "float_gain_db": dB | null,             # outputs' gain with it in float
                                                              # (both absent: not measured; null: inf)
                      "runs": {run: metrics}}, ...],          # worst first (see `compare`)
           "outputs": {name: metrics}, "unmapped_tensors": [name, ...],
           "weights": [{"param", "module_path", "spec", "axis", "min": [...],
                        "max": [...], "outliers": [channel, ...], "levels",
                        "median_levels"}, ...],
           "advice": [{"edge", "module_path", "change", "rule": {Rule.to_dict()},
                       "why", "measured": null | {"output_sqnr_db", "gain_db",
                       "size_bytes", "size_delta_bytes", "litert_output_sqnr_db"}}, ...],
           "notes": [str, ...],
           "float_ops": [{"kind": "island" | "conversion", "op", "module_path",
                          "why", "count"}, ...]}              # absent in older reports

        metrics: {"sqnr_db" (null: no error; -999: float all zeros), "cosine",
        "max_abs", "mean_abs", "lsb", "clipped", "nan", "simulate_lsb",
        "hist": {"lo", "hi", "unit": "LSB" | "abs", "counts": [41 ints]}}.
        Output names are ``output_<i>`` (simulate) and ``output_<i> (<run>)``.
        """
        return {
            "format": "odmlq.report", "version": FORMAT_VERSION, "runs": list(self.runs),
            "edges": [{"edge": e.edge, "op": e.op, "module_path": e.module_path, "spec": e.spec,
                       "index": e.index, "who": e.who, "scale_from": e.scale_from,
                       **({} if e.alone_sqnr_db is None else {
                           "alone_sqnr_db": _finite_or_none(e.alone_sqnr_db),
                           "float_gain_db": _finite_or_none(e.float_gain_db)}),
                       "runs": {k: m.to_dict() for k, m in e.runs.items()}} for e in self.edges],
            "outputs": {k: m.to_dict() for k, m in self.outputs.items()},
            "unmapped_tensors": list(self.unmapped_tensors),
            "weights": [w.to_dict() for w in self.weights],
            "advice": [a.to_dict() for a in self.advice],
            "notes": list(self.notes),
            "float_ops": [f.to_dict() for f in self.float_ops],
        }

    def to_json(self, indent: int | None = 1) -> str:
        """`to_dict` as JSON text (strict JSON: no NaN or Infinity)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def to_html(self, *, title: str = "odmlq report") -> str:
        """One self-contained HTML page: tables and inline SVG plots (SQNR along
        the network per run, error histograms of the worst edges, per-channel
        weight ranges, advice); no scripts, nothing fetched."""
        from odmlq.report._html import render_html

        return render_html(self.to_dict(), title=title)

    def save_html(self, path, *, title: str = "odmlq report") -> str:
        """Writes `to_html` to `path` atomically; returns the path."""
        from odmlq.files import atomic_output

        page = self.to_html(title=title)
        with atomic_output(path) as temporary:
            with open(temporary, "w", encoding="utf-8") as f:
                f.write(page)
        return str(path)

    def to_model_explorer(self, tflite: bytes, *, plan, scales, metric: str = "local") -> dict:
        """Per-op SQNR (dB) of one run as Model Explorer node data for `tflite`.

        ``{graph id: {"name", "results": {op index: {"value": dB}}, "thresholds"}}``:
        red under 10 dB to green over 40; an infinite SQNR is written as
        200 dB. Ops that carry no edge get no entry. Format and mapping:
        `odmlq.report._model_explorer`.

        Args:
          tflite: the .tflite this report was made with (``compare(..., tflite=)``).
          plan, scales: what it was exported with (``Export.plan``, ``Export.scales``),
            to find each edge's tensor as the LiteRT run did.
          metric: the run whose SQNR to show: 'local', 'simulate', 'litert', ...

        Raises:
          OdmlqError: no LiteRT run in the report, or a metric it lacks.

        Example:
          >>> result = odmlq.export_tflite(model, rules, batches, variables=variables)
          >>> report = odmlq.compare(model, result.plan, result.scales, x, variables=variables,
          ...                        tflite=result.tflite)
          >>> report.save_model_explorer("local.json", result.tflite, plan=result.plan,
          ...                            scales=result.scales, metric="local")
        """
        from odmlq.report._model_explorer import node_data

        return node_data(self, tflite, plan, scales, metric)

    def save_model_explorer(self, path, tflite: bytes, *, plan, scales, metric: str = "local") -> str:
        """Writes `to_model_explorer` to `path` as JSON, atomically; returns the path."""
        from odmlq.report._model_explorer import save_node_data

        return save_node_data(path, self.to_model_explorer(tflite, plan=plan, scales=scales, metric=metric))

    @classmethod
    def from_json(cls, text: str | dict) -> "Report":
        """Reads `to_json` (or `to_dict`) back.

        Raises:
          ReportError: not odmlq report JSON, or another format version.
        """
        try:
            d = json.loads(text) if isinstance(text, str) else text
        except json.JSONDecodeError as e:
            raise ReportError(f"Not a report: JSON error at line {e.lineno}: {e.msg}.") from None
        if not isinstance(d, dict) or d.get("format") != "odmlq.report":
            raise ReportError("Not an odmlq report (no 'format': 'odmlq.report' field).")
        if d.get("version") != FORMAT_VERSION:
            raise ReportError(f"Report format version {d.get('version')!r} is not supported (this odmlq "
                              f"reads version {FORMAT_VERSION}); run compare() again.")
        edges = tuple(EdgeReport(edge=e["edge"], op=e["op"], module_path=e["module_path"], spec=e["spec"],
                                 index=e["index"], scale_from=e.get("scale_from"),
                                 alone_sqnr_db=_inf_if_none(e, "alone_sqnr_db"),
                                 float_gain_db=_inf_if_none(e, "float_gain_db"),
                                 runs={k: EdgeMetrics.from_dict(m) for k, m in e["runs"].items()})
                      for e in d["edges"])
        return cls(edges=edges, outputs={k: EdgeMetrics.from_dict(m) for k, m in d["outputs"].items()},
                   unmapped_tensors=tuple(d["unmapped_tensors"]),
                   weights=tuple(WeightRange.from_dict(w) for w in d["weights"]),
                   advice=tuple(Advice.from_dict(a) for a in d["advice"]), notes=tuple(d["notes"]),
                   run_names=tuple(d["runs"]),
                   float_ops=tuple(FloatOp.from_dict(f) for f in d.get("float_ops") or ()))

    def __str__(self) -> str:
        return _report_text.render(self)


def compare(model: Any, plan, scales, *inputs: Any, variables: Any = None, tflite: bytes | None = None,
            xla: Any = None, device: Mapping[str, np.ndarray] | None = None, calibration: Any = None,
            rep_dataset: Iterable | None = None, try_fixes: bool = False,
            max_advice: int = 3, contributions: bool = True, progress: bool | None = None) -> Report:
    """Lines up float, simulate, local and backend runs edge by edge, and advises.

    Args:
      model, plan, scales, variables: the quantized model (see `simulate`).
      *inputs: a batch of inputs (for LiteRT, split into the model's batch size).
      tflite: an exported model to add as the 'litert' run. A .tflite whose
        tensors map to no plan edge (not made by odmlq from this plan) is
        compared at its outputs only, and the report says so.
      xla: a `QuantizedModel` of this plan (`odmlq.ptq`), added as the 'xla' run.
      device: tensors of `tflite` dumped on a device for one invocation on
        `inputs` (by tensor name; `samples/dump_tensors.py`): the 'device' run.
      calibration: the statistics `scales` came from; names each edge's
        calibration method in advice, and is needed by `try_fixes`.
      rep_dataset: representative batches, for the edges a suggested rule
        must observe again (see `try_fixes`).
      try_fixes: measure each suggestion: re-plan with its rule first, scales
        from `calibration`, outputs vs float with simulate (and with a
        `tflite`, re-exported: size and LiteRT outputs).
      max_advice: at most this many edges get advice.
      contributions: also run the model twice per quantized edge, with only
        that edge quantized and with only it in float (`EdgeReport.alone_sqnr_db`,
        `float_gain_db`, `Report.contributors`): the edges that cost the
        outputs most, which advice considers first.
      progress: a bar on stderr while fixes are tried (default: when stderr
        is a terminal).

    Returns:
      A `Report`, edges ranked by local SQNR (worst first).

    Raises:
      CalibrationError: inputs that do not fit the model (naming the input
        and the shape it takes); `try_fixes` without `calibration`.
      OdmlqError: inputs that do not fit the .tflite; a `device` dump
        without `tflite`, or of other shapes; `scales` that are not scales
        (a Calibration).
      PlanError: an `xla` model made from another plan.
    """
    from odmlq.report import _advice as _report_advice
    from odmlq.report import _fixes as _report_fixes
    from odmlq.report import _runs as _report_runs
    from odmlq.graph import GraphCache, check_inputs, params_for
    from odmlq.report._weights import weight_ranges
    from odmlq.errors import CalibrationError
    from odmlq.simulate import Simulator

    if device is not None and tflite is None:
        raise OdmlqError("compare(device=...) needs tflite=: the .tflite the device ran.")
    if not hasattr(scales, "shifts"):
        raise OdmlqError(f"compare's third argument is the plan's scales, got {type(scales).__name__}: pass "
                         "odmlq.compute_scales(plan, calibration, variables), and the calibration as "
                         "calibration= (advice reads it).")
    if try_fixes and calibration is None:
        raise CalibrationError("compare(try_fixes=True) needs calibration=: the statistics the scales "
                               "came from (odmlq.calibrate or Calibration.load).")
    check_inputs(plan.graph, inputs, "compare")
    if xla is not None:
        _report_runs.check_xla(xla, plan)
    params = params_for(model, variables, "compare")
    graph = GraphCache(model, plan, variables).graph_for(inputs)
    float_out, floats = _report_runs.float_run(graph, params, inputs, scales.shifts)
    simulator = Simulator(model, plan, scales, variables=variables)
    sim_out, simulated = simulator(*inputs, capture=True)
    _, local = simulator(*inputs, capture=True, feed=floats)
    outputs = {f"output_{i}": edge_metrics(f, s)
               for i, (f, s) in enumerate(zip(float_out, leaves(sim_out)))}
    backends, more_outputs, unmapped, notes = _report_runs.backend_runs(plan, scales, inputs, float_out, xla,
                                                                         tflite, device, graph)
    outputs.update(more_outputs)
    reports = _edge_reports(plan, scales, floats, {"local": local, "simulate": simulated}, backends)
    looped = sum(1 for e in plan.graph.edges.values() if e.alias is None and _in_loop(plan.graph, e))
    if looped:
        notes.append(f"{looped} edge(s) inside loops (lax.scan: nn.RNN, nn.scan) are compared through the "
                     "loops' outputs only: each holds another value at every step.")
    if contributions:
        from odmlq.report._contribution import contributions as measure_contributions

        measured = measure_contributions(model, plan, scales, inputs, float_out, variables=variables,
                                         groups={e.edge: e.scale_from for e in reports if e.scale_from})
        reports = [dataclasses.replace(e, alone_sqnr_db=measured[e.edge][0], float_gain_db=measured[e.edge][1])
                   if e.edge in measured else e for e in reports]
    weights = weight_ranges(plan, params, scales)
    found = float_ops(plan, tflite)
    islands = tflite is not None and _has_float_ops(plan, found)
    advice, advice_notes = _report_advice.propose(
        plan, reports, weights=weights, calibration=calibration, floats=floats, litert=tflite is not None,
        allow_float_ops=islands, limit=max_advice,
        output_sqnr_db=min((m.sqnr_db for k, m in outputs.items() if "(" not in k), default=math.inf))
    notes += advice_notes
    if try_fixes and advice:
        trials = _report_fixes.FixTrials(
            model=model, variables=variables, plan=plan, calibration=calibration,
            rep_dataset=None if rep_dataset is None else list(rep_dataset), inputs=tuple(inputs),
            float_outputs=float_out, tflite=tflite, allow_float_ops=islands)
        advice, measure_notes = _report_fixes.measure_all(trials, advice, progress=progress)
        notes += measure_notes
    present = {"local", "simulate", *backends} | {k[k.index("(") + 1:-1] for k in outputs if "(" in k}
    return Report(edges=tuple(reports), outputs=outputs, unmapped_tensors=tuple(unmapped),
                  weights=weights, advice=tuple(advice), notes=tuple(notes),
                  run_names=tuple(r for r in RUNS if r in present), float_ops=found)


def _in_loop(graph, edge) -> bool:
    """Whether a loop's body computes the edge (a capture keeps one step's value of it)."""
    return edge.producer is not None and graph.op(edge.producer).region is not None


def _edge_reports(plan, scales, floats: dict, own: dict, backends: dict) -> list[EdgeReport]:
    """Every edge's metrics in every run, worst local SQNR first. `own`: the
    local and simulate runs (edge values); `backends`: run -> (edge values, scales)."""
    reports = []
    for index, (edge_id, edge_plan) in enumerate(plan.edges.items()):
        edge = plan.graph.edges[edge_id]
        if edge_id not in floats or edge.alias or _in_loop(plan.graph, edge):
            continue
        ts = scales.edges.get(edge_id)
        calibration = edge_plan.spec.calibration if edge_plan.spec is not None else None
        # A mask's "minus infinity" is placed at the bottom of the range by
        # design (calibration.Masked): those positions are no error.
        sentinel = calibration.sentinel if isinstance(calibration, Masked) else None
        runs = {name: edge_metrics(floats[edge_id], values[edge_id], ts, masked_from=sentinel)
                for name, values in own.items()}
        for name, (values, backend_scales) in backends.items():
            if edge_id in values:
                bts = backend_scales.edges.get(edge_id)
                runs[name] = edge_metrics(floats[edge_id], values[edge_id], bts, masked_from=sentinel,
                                          simulate=own["simulate"][edge_id] if bts is not None else None)
        producer = plan.graph.edges[edge_id].producer
        source = _scale_source(plan, edge_id)
        reports.append(EdgeReport(
            edge=edge_id, op=producer, index=index,
            module_path=plan.graph.op(producer).module_path if producer else "",
            spec=edge_plan.spec.describe() if edge_plan.spec else "float", runs=runs,
            scale_from=None if source == edge_id else source))
    return _ranked(reports)


def _scale_source(plan, edge_id: str) -> str:
    """The edge whose range sets `edge_id`'s scale: up through ops that keep
    their input's scale (SameAsInput: pools, reshapes, transposes)."""
    seen = set()
    while edge_id not in seen:
        seen.add(edge_id)
        edge_plan, edge = plan.edges.get(edge_id), plan.graph.edges[edge_id]
        if edge_plan is None or not isinstance(edge_plan.constraint, SameAsInput) or edge.producer is None:
            return edge_id
        inputs = plan.graph.op(edge.producer).inputs
        if not inputs:
            return edge_id
        edge_id = plan.graph.resolve(inputs[0])
    return edge_id


def _ranked(reports: list[EdgeReport]) -> list[EdgeReport]:
    """Worst local SQNR first, except that edges sharing one scale rank
    together, at their worst member's place, the edge whose range sets the
    scale first: a range fault there clips every edge of the group, and the
    group's pools (which keep the maxima) often clip most."""
    by_edge = {e.edge: e for e in reports}
    group: dict[str, list[EdgeReport]] = {}
    for e in reports:
        group.setdefault(e.scale_from or e.edge, []).append(e)

    def key(e: EdgeReport):
        root = e.scale_from or e.edge
        members = group[root]
        worst = min(m.local_sqnr_db for m in members)
        worst_sim = min(m.runs["simulate"].sqnr_db for m in members)
        own = (0, e.local_sqnr_db) if e.edge == root or root not in by_edge else (1, e.local_sqnr_db)
        return (worst, worst_sim, root, *own, e.runs["simulate"].sqnr_db)

    return sorted(reports, key=key)


def _finite_or_none(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


def _inf_if_none(entry: dict, key: str) -> float | None:
    """A stored SQNR: absent (not measured) stays None; null is no error (inf)."""
    if key not in entry:
        return None
    return math.inf if entry[key] is None else float(entry[key])


def _has_float_ops(plan, found: tuple[FloatOp, ...]) -> bool:
    """Whether the compared .tflite runs some ops in float (so re-exports may
    too): planned so, or among its float islands (`found`)."""
    from odmlq.litert.export import check_plan

    try:
        planned = bool(check_plan(plan, allow_float_ops=True))
    except OdmlqError:
        planned = False
    return planned or any(f.kind == "island" for f in found)
