"""compare(): per-edge metrics, local vs inherited error, xla and LiteRT runs, on the trained digits CNN."""

import functools
import json
import math

import flax.linen as nn
import jax
import numpy as np
import pytest

import odmlq
from odmlq.calibration import FixedRange
from odmlq.report import Report, ReportError, edge_metrics
from odmlq.scales import TensorScale
from samples.digits import batches, load_digits_splits, train

INT8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


@functools.cache
def trained_cnn():
    """The digits CNN, trained once per test session (tests/test_report_*.py share it)."""
    digits = load_digits_splits()
    model, variables = train("cnn", digits, seconds=20, max_steps=300)
    plan = odmlq.plan(model, INT8, digits.x_test[:1], variables=variables)
    calibration = odmlq.calibrate(model, plan, batches(digits.x_calibration, 32), variables=variables)
    return digits, model, variables, plan, calibration


def planted_fault(calibration, edge="conv2/relu"):
    """The calibration with `edge`'s range made 10x too small."""
    lo, hi = calibration.range(edge, "int8", symmetric=False)
    faulty = odmlq.Calibration(dict(calibration))
    faulty.observe(f"{edge}_fault", FixedRange(float(lo) / 10, float(hi) / 10), np.zeros(1))
    entries = dict(calibration)
    entries[edge] = faulty[f"{edge}_fault"]
    return odmlq.Calibration(entries)


@pytest.fixture(scope="module")
def cnn():
    return trained_cnn()


def test_planted_fault_is_ranked_first_and_local(cnn):
    """One activation edge calibrated with a range 10x too small."""
    digits, model, variables, plan, calibration = cnn
    scales = odmlq.compute_scales(plan, planted_fault(calibration), variables)
    report = odmlq.compare(model, plan, scales, digits.x_test[:64], variables=variables)
    first = report.edges[0]
    assert first.edge == "conv2/relu", str(report)
    local, total = first.runs["local"], first.runs["simulate"]
    # Local error dominates: the edge introduces (nearly) all the error it carries.
    assert local.sqnr_db < 15 and abs(local.sqnr_db - total.sqnr_db) < 1.0, str(report)
    assert local.clipped > 0.05  # a tenth of the range clips many values
    downstream = {e.edge: e for e in report.edges}["dense1/relu"]
    assert downstream.runs["local"].sqnr_db > 30 and downstream.runs["simulate"].sqnr_db < 15
    assert "inherited" in str(report) and "local" in str(report)


def test_compare_against_itself_is_exact(cnn):
    digits, model, variables, _, _ = cnn
    plan = odmlq.plan(model, [], digits.x_test[:1], variables=variables)
    scales = odmlq.compute_scales(plan, None, variables)
    report = odmlq.compare(model, plan, scales, digits.x_test[:16], variables=variables)
    assert report.edges and not report.advice and not report.weights
    for e in report.edges:
        for metrics in e.runs.values():
            assert metrics.sqnr_db == math.inf and metrics.max_abs == 0 and metrics.cosine == pytest.approx(1.0)
            assert metrics.hist.counts[20] == sum(metrics.hist.counts)  # every error in the zero bin
    assert all(m.sqnr_db == math.inf for m in report.outputs.values())


def test_xla_run_is_within_one_lsb_of_simulate_on_every_static_edge(cnn):
    """The XLA model's int8 x int8 -> int32 kernels may round a tie the other way: 1 LSB."""
    digits, model, variables, plan, calibration = cnn
    scales = odmlq.compute_scales(plan, calibration, variables)  # as ptq computes them
    qmodel = odmlq.ptq(model, plan, variables, calibration)
    report = odmlq.compare(model, plan, scales, digits.x_test[:64], variables=variables, xla=qmodel)
    static = [e for e in report.edges if e.edge in scales.edges]
    assert len(static) == 7 and all("xla" in e.runs for e in static)
    lsb = {e.edge: e.runs["xla"].simulate_lsb for e in static}
    assert max(lsb.values()) <= 1.0 + 1e-3, lsb
    for e in static:  # within 1 LSB of simulate, so as far from float as simulate is
        assert e.runs["xla"].sqnr_db == pytest.approx(e.runs["simulate"].sqnr_db, abs=0.5), e.edge
    assert report.runs == ("local", "simulate", "xla")
    text = str(report)
    assert "xla dB" in text and "xla-sim LSB" in text and "output_0 (xla)" in text
    data = json.loads(report.to_json())
    assert data["runs"] == ["local", "simulate", "xla"]
    assert all("xla" in e["runs"] for e in data["edges"] if e["edge"] in scales.edges)
    assert data["outputs"]["output_0 (xla)"]["sqnr_db"] > 30


def test_a_calibration_passed_as_scales_is_named_with_the_fix(cnn):
    digits, model, variables, plan, calibration = cnn
    with pytest.raises(odmlq.OdmlqError, match=r"got Calibration: pass odmlq.compute_scales\(plan, calibration"):
        odmlq.compare(model, plan, calibration, digits.x_test[:4], variables=variables)


def test_an_xla_model_of_another_plan_is_refused(cnn):
    from samples.models import mlp

    digits, model, variables, plan, calibration = cnn
    other, (x,), other_variables = mlp()
    qmodel = odmlq.ptq(other, [odmlq.Rule(".*", weight_qtype="int8")], other_variables, example_inputs=(x,))
    scales = odmlq.compute_scales(plan, calibration, variables)
    with pytest.raises(odmlq.PlanError, match="QuantizedModel was made from a plan with other ops"):
        odmlq.compare(model, plan, scales, digits.x_test[:4], variables=variables, xla=qmodel)


def test_litert_run_lines_up_with_simulate(cnn):
    digits, model, variables, _, _ = cnn
    result = odmlq.export_tflite(model, INT8, batches(digits.x_calibration, 32), variables=variables)
    report = odmlq.compare(model, result.plan, result.scales, digits.x_test[:32], variables=variables,
                           tflite=result.tflite)
    quantized = [e for e in report.edges if e.spec != "float"]
    assert quantized and all("litert" in e.runs for e in quantized)
    for e in quantized:  # the export is bit-exact with simulate on this model
        assert e.runs["litert"].sqnr_db == pytest.approx(e.runs["simulate"].sqnr_db, abs=0.01)
        assert e.runs["litert"].simulate_lsb <= 1.0 + 1e-3
    data = json.loads(report.to_json())
    assert data["format"] == "odmlq.report" and len(data["edges"]) == len(report.edges)
    assert data["runs"] == ["local", "simulate", "litert"] and not report.notes
    with pytest.raises(odmlq.OdmlqError, match=r"Input 'input 0' has shape \(32, 8, 7, 1\).*takes \(1, 8, 8, 1\)"):
        from odmlq.report._runs import check_litert_inputs
        from odmlq.litert.verify import preserving_interpreter

        check_litert_inputs(preserving_interpreter(result.tflite), [np.zeros((32, 8, 7, 1), np.float32)])


def test_inputs_that_do_not_fit_the_model_are_named_with_the_shape(cnn):
    digits, model, variables, plan, calibration = cnn
    scales = odmlq.compute_scales(plan, calibration, variables)
    with pytest.raises(odmlq.CalibrationError, match=r"compare, input 0: shape \(4, 8, 7, 1\).*\(1, 8, 8, 1\)"):
        odmlq.compare(model, plan, scales, digits.x_test[:4, :, :7], variables=variables)


def test_json_follows_the_contract_and_reads_back(cnn):
    digits, model, variables, plan, calibration = cnn
    faulty = planted_fault(calibration)
    scales = odmlq.compute_scales(plan, faulty, variables)
    report = odmlq.compare(model, plan, scales, digits.x_test[:16], variables=variables, calibration=faulty)
    data = json.loads(report.to_json())
    assert set(data) == {"format", "version", "runs", "edges", "outputs", "unmapped_tensors", "weights",
                         "advice", "notes", "float_ops"}
    assert data["float_ops"] == []  # an all-int8 plan, no .tflite: nothing in float, no conversion
    assert data["version"] == 2 and data["runs"] == ["local", "simulate"]
    order = list(plan.graph.edges)
    for e in data["edges"]:
        assert {"edge", "op", "module_path", "spec", "index", "who", "scale_from", "runs"} <= set(e)
        assert order[e["index"]] == e["edge"] and e["who"] in ("local", "inherited", "shared", "-")
        assert e["scale_from"] is None or e["scale_from"] in order
        for m in e["runs"].values():
            assert {"sqnr_db", "cosine", "max_abs", "mean_abs", "lsb", "clipped", "nan", "hist"} <= set(m)
            hist = m["hist"]
            assert len(hist["counts"]) == 41 and hist["lo"] == -hist["hi"] and hist["unit"] in ("LSB", "abs")
            assert sum(hist["counts"]) == int(np.prod(plan.graph.edges[e["edge"]].shape[1:])) * 16
    assert data["edges"][0]["edge"] == "conv2/relu" and data["edges"][0]["runs"]["simulate"]["hist"]["unit"] == "LSB"
    assert {"param", "module_path", "spec", "axis", "min", "max", "outliers"} <= set(data["weights"][0])
    advice = data["advice"][0]
    assert {"edge", "module_path", "change", "rule", "why", "measured"} <= set(advice)
    assert advice["measured"] is None and advice["rule"]["module_path"] == "conv2"
    again = Report.from_json(report.to_json())
    assert again.to_json() == report.to_json()
    assert str(again) == str(report)


@pytest.mark.parametrize("text, match", [
    ("{", "JSON error at line 1"),
    ('{"format": "odmlq.plan"}', "Not an odmlq report"),
    ('{"format": "odmlq.report", "version": 1}', "version 1 is not supported"),
])
def test_bad_report_json_is_refused(text, match):
    with pytest.raises(ReportError, match=match):
        Report.from_json(text)


def test_nan_is_reported_not_a_huge_error():
    ref = np.ones(8, np.float32)
    value = ref.copy()
    value[3] = np.nan
    m = edge_metrics(ref, value)
    assert m.nan == 1 and math.isfinite(m.max_abs) and m.max_abs == 0
    assert sum(m.hist.counts) == 7  # the NaN is not counted as an error either


def test_error_histogram_counts_whole_lsbs_around_zero():
    ts = TensorScale(qtype="int8", scale=np.full((1,), 0.5, np.float32))
    ref = np.zeros(6)
    value = np.array([0.0, 0.5, -0.5, 1.5, 10.0, -10.0])  # 0, 1, -1, 3, 20, -20 LSB
    hist = edge_metrics(ref, value, ts).hist
    assert hist.unit == "LSB" and (hist.lo, hist.hi) == (-20.5, 20.5)
    expected = np.zeros(41, int)
    for k in (0, 1, -1, 3, 20, -20):
        expected[20 + k] += 1
    np.testing.assert_array_equal(hist.counts, expected)
    wide = edge_metrics(ref[:2], np.array([0.0, 50.0]), ts).hist  # 100 LSB: 5-LSB bins
    assert wide.hi == 20.5 * 5 and wide.counts[40] == 1 and wide.counts[20] == 1
    absolute = edge_metrics(ref[:2], np.array([0.0, -2.0])).hist
    assert absolute.unit == "abs" and absolute.hi == pytest.approx(2.05) and absolute.counts[0] == 1


def test_a_tflite_odmlq_did_not_make_is_compared_at_its_outputs_only(cnn):
    from odmlq.litert import _convert
    from odmlq.report import NOT_ODMLQ

    digits, model, variables, plan, calibration = cnn
    plain = _convert.convert(lambda x: model.apply(variables, x), (digits.x_test[:1],), input_names=["x"],
                             output_names=["output_0"])
    scales = odmlq.compute_scales(plan, calibration, variables)
    report = odmlq.compare(model, plan, scales, digits.x_test[:8], variables=variables, tflite=plain)
    assert not any("litert" in e.runs for e in report.edges)
    assert report.notes[0].startswith(NOT_ODMLQ) and NOT_ODMLQ in str(report)
    assert report.outputs["output_0 (litert)"].sqnr_db > 100  # the float model, float32 noise
    assert report.runs == ("local", "simulate", "litert")
    with pytest.raises(odmlq.OdmlqError, match="compare.device=.... needs tflite="):
        odmlq.compare(model, plan, scales, digits.x_test[:1], variables=variables, device={})


class _PoolCnn(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3), name="conv")(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(4, name="head")(x.reshape((x.shape[0], -1)))


def test_a_fault_behind_a_max_pool_ranks_first_through_the_shared_scale():
    """The ReLU's range made 10x too small: the max pool and the reshape keep
    its scale, so they clip too, the pool most (it keeps the maxima). The
    fault's own edge ranks first (it was third, behind both), and the others
    name it as the source of their scale."""
    model = _PoolCnn()
    rng = np.random.default_rng(0)
    data = [rng.normal(size=(16, 8, 8, 3)).astype(np.float32) for _ in range(4)]
    variables = model.init(jax.random.key(0), data[0][:1])
    plan = odmlq.plan(model, INT8, data[0][:1], variables=variables)
    calibration = odmlq.calibrate(model, plan, data, variables=variables)
    scales = odmlq.compute_scales(plan, planted_fault(calibration, "conv/relu"), variables)
    report = odmlq.compare(model, plan, scales, data[0], variables=variables)
    order = [e.edge for e in report.edges]
    assert order[0] == "conv/relu", str(report)
    shared = [e for e in report.edges if e.scale_from == "conv/relu"]
    assert {plan.graph.op(e.op).kind for e in shared} >= {"max_pool", "reshape"}
    assert [e.edge for e in report.edges[1:1 + len(shared)]] == [e.edge for e in shared]
    pool = next(e for e in shared if plan.graph.op(e.op).kind == "max_pool")
    assert pool.local_sqnr_db < report.edges[0].local_sqnr_db  # it clips more, yet ranks behind
    assert pool.who == "shared" and report.edges[0].who == "local"
    assert Report.from_json(report.to_json()).edges[1].scale_from == "conv/relu"


def test_a_masks_sentinel_is_no_error():
    """A Masked edge places the mask's finfo.min at the bottom of its range on
    purpose: the metrics leave those positions out, so that a mask edge is not
    ranked first at 0 dB and 1e38 LSB."""
    from odmlq.report._metrics import edge_metrics
    from odmlq.scales import TensorScale

    rng = np.random.default_rng(0)
    ref = rng.normal(size=(4, 16)).astype(np.float32)
    ref[:, 12:] = np.finfo(np.float32).min
    scale = TensorScale(scale=np.float32(0.05), zero_point=np.int32(0), qtype=odmlq.qtype("int8"))
    value = np.round(np.clip(ref, -6.4, 6.35) / 0.05) * 0.05  # the sentinel at the bottom
    plain = edge_metrics(ref, value, scale)
    masked = edge_metrics(ref, value, scale, masked_from=1e8)
    assert plain.sqnr_db < 1 and plain.lsb > 1e30  # what the report showed before
    # Only rounding is left: within half a step (1e-3 LSB of float32 slack),
    # and the SQNR of uniform rounding noise on unit-variance data at step 0.05 (~33 dB).
    assert masked.lsb <= 0.5 + 1e-3 and masked.sqnr_db > 30
    assert sum(masked.hist.counts) == 4 * 12
