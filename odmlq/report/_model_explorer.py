"""A report's per-edge SQNR as Model Explorer node data for the exported .tflite (internal).

Model Explorer (https://github.com/google-ai-edge/model-explorer) overlays
"node data" on a graph: numbers per node, coloured by thresholds. The file is
a JSON object keyed by graph id::

  {"main": {"name": "odmlq local SQNR (dB)",
            "results": {"3": {"value": 2.98}, "5": {"value": 44.6}, ...},
            "thresholds": [{"value": 10, "bgColor": "#d73027"}, ...]}}

A node whose value is <= a threshold's value (the first such, in order) gets
that threshold's background colour. For a .tflite opened with Model
Explorer's built-in flatbuffer adapter, a node id is the operator's index in
the subgraph (as a string) and the graph id is the subgraph's name, else the
signature key of its signature, else ``main``.

Load the file in Model Explorer's UI ("Add per-node data") or with
``model_explorer.visualize(path.tflite, node_data_paths=[path.json])``.

References:
  Format: ``src/server/package/src/model_explorer/node_data_builder.py``
  (ModelNodeData, GraphNodeData, NodeDataResult, ThresholdItem) and
  ``src/ui/src/components/visualizer/common/types.ts``
  (NodeDataProviderData, NodeDataProviderGraphData: ``name``); how a file is
  read and coloured: ``src/ui/src/components/visualizer/
  node_data_provider_extension_service.ts``; node and graph ids of a
  .tflite: ``src/builtin-adapter/adapters/litert/
  direct_flatbuffer_to_json_graph_convert.cc`` (``SubgraphBuildContext``,
  ``GetSubgraphName``). All in github.com/google-ai-edge/model-explorer.
"""

from __future__ import annotations

import json
import math
import os

from odmlq.errors import OdmlqError

# An edge with no error has an infinite SQNR; JSON has no Infinity, so it is
# written as this (and -inf, float all zeros but the run not, as its negative).
# 200 dB is far above any quantized tensor (int16 reaches about 100 dB) and
# still only float32 rounding away from exact.
SQNR_CAP_DB = 200.0

# Upper bounds in dB, worst first (ColorBrewer RdYlGn): under 10 dB a tensor
# is mostly noise, 30-40 dB is a well-calibrated int8 tensor.
THRESHOLDS = ((10.0, "#d73027"), (20.0, "#fc8d59"), (30.0, "#fee08b"), (40.0, "#91cf60"),
              (SQNR_CAP_DB, "#1a9850"))


def node_data(report, tflite: bytes, plan, scales, metric: str) -> dict:
    """`report`'s `metric` SQNR per operator of `tflite`'s main subgraph.

    Each plan edge is traced to the tensor that carries it as the report's
    LiteRT run traced it (`odmlq.litert.verify.map_tensors`), and that
    tensor to the operator that writes it. An operator that writes several
    edges gets the lowest SQNR; one that writes none (a DEQUANTIZE to a
    float output, an edge fused away) gets no entry.

    Args:
      report: a `Report` from ``odmlq.compare(..., tflite=tflite)``.
      tflite: the .tflite the report's LiteRT run ran.
      plan, scales: what `tflite` was exported with (``Export.plan``, ``.scales``).
      metric: one of the report's runs ('local', 'simulate', 'litert', ...).

    Returns:
      Model Explorer node data: ``{graph id: {"name", "results", "thresholds"}}``.

    Raises:
      OdmlqError: a report without a LiteRT run, a metric it lacks, or a
        .tflite none of whose tensors carries an edge of the report.
    """
    from odmlq.litert.verify import preserving_interpreter
    from odmlq.litert.inspect import inspect
    from odmlq.litert.verify import map_tensors

    edges = {e.edge: e for e in report.edges}
    if not any("litert" in e.runs for e in edges.values()):
        raise OdmlqError(
            "Report.to_model_explorer needs a report with a LiteRT run on every edge: make it with "
            "odmlq.compare(model, plan, scales, *inputs, tflite=<the exported .tflite>) for a .tflite "
            "odmlq exported, and pass the same .tflite, plan and scales here.")
    if metric not in report.runs or not any(metric in e.runs for e in edges.values()):
        choices = [r for r in report.runs if any(r in e.runs for e in edges.values())]
        raise OdmlqError(f"metric={metric!r} is not a run of this report; choose one of {choices}.")
    summary = inspect(tflite)
    producer = {t: op.index for op in summary.ops for t in op.outputs}
    interpreter = preserving_interpreter(tflite)
    details = interpreter.get_tensor_details()
    mapping = map_tensors(details, set(producer), plan, scales, ops=interpreter._get_ops_details())
    values: dict[int, float] = {}
    for edge, tensor in mapping.items():
        if edge in edges and metric in edges[edge].runs:
            op = producer[tensor]
            values[op] = min(values.get(op, math.inf), _capped(edges[edge].runs[metric].sqnr_db))
    if not values:
        raise OdmlqError(
            "No tensor of this .tflite carries an edge of the report: pass the .tflite, plan and "
            "scales the report was made with (odmlq.compare(..., tflite=...)).")
    return {_graph_id(tflite): {
        "name": f"odmlq {metric} SQNR (dB)",
        "results": {str(op): {"value": round(v, 2)} for op, v in sorted(values.items())},
        "thresholds": [{"value": bound, "bgColor": color} for bound, color in THRESHOLDS],
    }}


def save_node_data(path: str | os.PathLike, data: dict) -> str:
    """Writes node data as strict JSON to `path` atomically; returns the path."""
    from odmlq.files import atomic_output

    text = json.dumps(data, indent=1, allow_nan=False)
    with atomic_output(path) as temporary:
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(text)
    return os.fspath(path)


def _capped(sqnr_db: float) -> float:
    return max(-SQNR_CAP_DB, min(SQNR_CAP_DB, sqnr_db))


def _graph_id(tflite: bytes) -> str:
    """Model Explorer's id of the main subgraph: its name, else its signature key, else 'main'.

    Older Model Explorer releases skip the signature key; a subgraph the
    converter named (odmlq's exports are named 'main') reads the same in all.
    """
    from ai_edge_litert import schema_py_generated as schema

    model = schema.Model.GetRootAs(bytes(tflite), 0)
    name = (model.Subgraphs(0).Name() or b"").decode()
    if name:
        return name
    for i in range(model.SignatureDefsLength()):
        signature = model.SignatureDefs(i)
        if signature.SubgraphIndex() == 0:
            return (signature.SignatureKey() or b"").decode() or "main"
    return "main"
