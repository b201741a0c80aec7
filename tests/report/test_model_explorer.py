"""Report.to_model_explorer: per-op SQNR of the exported digits CNN as Model Explorer node data.

The format (graph id -> {"results": {node id: {"value"}}, "thresholds"}) is
Model Explorer's node_data_builder.py; node ids of a .tflite are operator
indices of the subgraph (see odmlq/_report_model_explorer.py).
"""

import dataclasses
import json
import math

import flatbuffers
import numpy as np
import pytest

import odmlq
from odmlq import cli
from odmlq.report._model_explorer import SQNR_CAP_DB, THRESHOLDS, _graph_id
from odmlq.litert.inspect import inspect
from odmlq.report import EdgeMetrics
from samples.digits import batches
from tests.report.test_report import planted_fault, trained_cnn

WEIGHTED = ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED")


@pytest.fixture(scope="module")
def faulty():
    """The int8 digits CNN exported with conv2/relu's range 10x too small, and its LiteRT report."""
    digits, model, variables, plan, calibration = trained_cnn()
    result = odmlq.export_tflite(model, plan, batches(digits.x_calibration, 32), variables=variables,
                                 calibration=planted_fault(calibration))
    report = odmlq.compare(model, result.plan, result.scales, digits.x_test[:32], variables=variables,
                           tflite=result.tflite)
    return result, report


def _node_data(faulty, metric="local", report=None):
    result, own = faulty
    return (report or own).to_model_explorer(result.tflite, plan=result.plan, scales=result.scales,
                                             metric=metric)


def _op_writing(summary, edge):
    return next(op for op in summary.ops if any(edge in summary.tensors[t].name for t in op.outputs))


@pytest.mark.parametrize("metric", ["local", "simulate", "litert"])
def test_node_data_has_model_explorers_structure_and_finds_the_fault(faulty, metric):
    result, report = faulty
    data = _node_data(faulty, metric)
    assert json.loads(json.dumps(data, allow_nan=False)) == data  # strict JSON
    assert list(data) == ["main"]  # the subgraph's name, Model Explorer's graph id
    graph = data["main"]
    assert set(graph) == {"name", "results", "thresholds"} and metric in graph["name"]
    assert graph["thresholds"] == [{"value": v, "bgColor": c} for v, c in THRESHOLDS]
    assert [t["value"] for t in graph["thresholds"]] == sorted(t["value"] for t in graph["thresholds"])
    summary = inspect(result.tflite)
    results = graph["results"]
    assert set(results) <= {str(op.index) for op in summary.ops}
    assert all(set(r) == {"value"} and -SQNR_CAP_DB <= r["value"] <= SQNR_CAP_DB for r in results.values())
    values = {int(k): r["value"] for k, r in results.items()}
    conv2 = _op_writing(summary, "conv2/relu")  # the ReLU is fused into the convolution
    assert conv2.name == "CONV_2D"
    # conv2/reshape shares conv2/relu's scale (a RESHAPE keeps it), so it may tie.
    assert values[conv2.index] == min(values.values()) and values[conv2.index] < 15, values
    quantized = [op for op in summary.ops if op.name in WEIGHTED
                 and summary.tensors[op.outputs[0]].dtype == "int8"]
    assert len(quantized) == 5 and all(op.index in values for op in quantized), values
    assert not any(op.index in values for op in summary.ops if op.name == "DEQUANTIZE")
    sqnr = {e.edge: e.runs[metric].sqnr_db for e in report.edges if metric in e.runs}
    assert values[conv2.index] == pytest.approx(sqnr["conv2/relu"], abs=0.005)


def test_local_marks_only_the_fault_and_simulate_what_inherits_it(faulty):
    """Local error is what an op introduces; simulate's is what reaches it from upstream too."""
    summary = inspect(faulty[0].tflite)
    dense = [op.index for op in summary.ops if op.name == "FULLY_CONNECTED"]
    local = {int(k): r["value"] for k, r in _node_data(faulty, "local")["main"]["results"].items()}
    simulate = {int(k): r["value"] for k, r in _node_data(faulty, "simulate")["main"]["results"].items()}
    assert all(local[i] > 30 and simulate[i] < 15 for i in dense), (local, simulate)


def test_infinite_sqnr_is_written_as_the_cap(faulty):
    result, report = faulty
    exact = EdgeMetrics(sqnr_db=math.inf, cosine=1.0, max_abs=0.0, mean_abs=0.0, lsb=0.0, clipped=0.0)
    edges = tuple(dataclasses.replace(e, runs={**e.runs, "local": exact}) if e.edge == "conv2/relu" else e
                  for e in report.edges)
    data = _node_data(faulty, report=dataclasses.replace(report, edges=edges))
    conv2 = _op_writing(inspect(result.tflite), "conv2/relu")
    assert data["main"]["results"][str(conv2.index)] == {"value": SQNR_CAP_DB}
    json.dumps(data, allow_nan=False)


def test_save_writes_the_same_json_and_nothing_else(faulty, tmp_path):
    result, report = faulty
    path = tmp_path / "out" / "litert.json"
    path.parent.mkdir()
    written = report.save_model_explorer(path, result.tflite, plan=result.plan, scales=result.scales,
                                         metric="litert")
    assert written == str(path) and json.loads(path.read_text()) == _node_data(faulty, "litert")
    assert [p.name for p in path.parent.iterdir()] == ["litert.json"]


def test_a_report_without_a_litert_run_names_what_to_pass(faulty):
    result, _ = faulty
    digits, model, variables, _, _ = trained_cnn()
    report = odmlq.compare(model, result.plan, result.scales, digits.x_test[:8], variables=variables)
    with pytest.raises(odmlq.OdmlqError, match=r"needs a report with a LiteRT run.*compare\(.*tflite="):
        _node_data(faulty, report=report)


def test_a_metric_the_report_lacks_lists_the_choices(faulty):
    with pytest.raises(odmlq.OdmlqError,
                       match=r"metric='xla' is not a run of this report; choose one of "
                             r"\['local', 'simulate', 'litert'\]"):
        _node_data(faulty, "xla")


def test_a_tflite_the_report_was_not_made_with_is_refused(faulty):
    from odmlq.litert import _convert

    result, report = faulty
    digits, model, variables, _, _ = trained_cnn()
    plain = _convert.convert(lambda x: model.apply(variables, x), (digits.x_test[:1],), input_names=["x"],
                             output_names=["output_0"])
    with pytest.raises(odmlq.OdmlqError, match="No tensor of this .tflite carries an edge of the report"):
        report.to_model_explorer(plain, plan=result.plan, scales=result.scales)


def test_graph_id_falls_back_to_the_signature_key_then_main(faulty):
    """Model Explorer's GetSubgraphName: the subgraph's name, else its signature's key, else 'main'."""
    from ai_edge_litert import schema_py_generated as schema

    def repack(m) -> bytes:
        builder = flatbuffers.Builder(1024)
        builder.Finish(m.Pack(builder), file_identifier=b"TFL3")
        return bytes(builder.Output())

    m = schema.ModelT.InitFromPackedBuf(faulty[0].tflite, 0)
    assert _graph_id(faulty[0].tflite) == "main" and m.subgraphs[0].name == b"main"
    m.subgraphs[0].name = None
    assert _graph_id(repack(m)) == "serving_default"
    m.signatureDefs = None
    assert _graph_id(repack(m)) == "main"


def test_odmlq_diff_writes_the_devices_sqnr_per_op(tmp_path, capsys):
    from odmlq.litert.device import dump_tensors
    from samples.models import cnn

    model, _, variables = cnn()
    data = np.random.default_rng(0).random((16, 8, 8, 1), np.float32)
    path = tmp_path / "m.tflite"
    result = odmlq.export_tflite(model, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")],
                                 [data[:8], data[8:]], path, variables=variables, verify=False)
    result.calibration.save(tmp_path / "calibration.npz")
    np.savez(tmp_path / "in.npz", x=data[:1])
    np.savez(tmp_path / "dump.npz", **dump_tensors(result.tflite, [data[:1]]))
    out = tmp_path / "device.json"
    common = ["diff", str(path), "--inputs", str(tmp_path / "in.npz"), "--device-tensors",
              str(tmp_path / "dump.npz"), "--model-explorer", str(out)]
    assert cli.main(common) == 1
    assert "--model-explorer needs --model" in capsys.readouterr().err and not out.exists()
    assert cli.main([*common, "--model", "samples.models:cnn", "--calibration",
                     str(tmp_path / "calibration.npz")]) == 0
    assert f"# wrote {out}" in capsys.readouterr().err
    graph = json.loads(out.read_text())["main"]
    summary = inspect(result.tflite)
    assert graph["name"] == "odmlq device SQNR (dB)"
    assert {str(op.index) for op in summary.ops if op.name in WEIGHTED} <= set(graph["results"])
