"""Targets: one Plan holds each target's constraints, so `ptq` and
`export_tflite` given the same rules and calibration compute the same scales
with no extra argument, and agree edge for edge.

Tolerances: scales are computed by one function from the same statistics, so
they are compared exactly; edge values of two integer paths on one grid may
differ by a rounding step: 1 LSB of the edge's scale (seen: 0).
"""

import jax
import numpy as np
import pytest

import odmlq
from odmlq import Rule
from odmlq.constraints import FixedScale, SameAsInput, SharedWithInputs
from odmlq.report._runs import litert_run
from samples.digits import batches, load_digits_splits
from samples.models import SAMPLES

INT8 = [Rule(".*", weight_qtype="int8", act_qtype="int8")]


@pytest.fixture(scope="module")
def digits():
    return load_digits_splits()


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_ptq_matches_the_litert_export_on_every_static_edge(name, digits):
    model, _, variables = SAMPLES[name]()
    export = odmlq.export_tflite(model, INT8, batches(digits.x_calibration, 64), variables=variables,
                                 verify=False)
    qmodel = odmlq.ptq(model, INT8, variables, export.calibration, example_inputs=(digits.x_test[:1],))
    assert qmodel.plan.targets == ("xla", "litert") and export.plan.targets == ("litert",)
    assert set(qmodel.scales.edges) == set(export.scales.edges)
    for edge_id, ts in export.scales.edges.items():
        np.testing.assert_array_equal(qmodel.scales.edges[edge_id].scale, ts.scale, err_msg=edge_id)
    x = digits.x_test[:32]
    _, xla_edges = qmodel(x, capture=True)
    run = litert_run(export.tflite, export.plan, export.scales, (x,))
    compared = 0
    for edge_id, ts in export.scales.edges.items():
        if edge_id not in run.edges:
            continue  # merged away by the converter (a fused activation's input, a reshape)
        lsb = np.asarray(ts.scale, np.float64)
        diff = np.abs(np.asarray(xla_edges[edge_id], np.float64) - run.edges[edge_id]) / lsb
        assert float(np.max(diff)) <= 1.0 + 1e-3, (edge_id, float(np.max(diff)))
        compared += 1
    assert compared >= 3, compared


def test_compare_lines_up_xla_and_litert_with_no_extra_argument(digits):
    model, _, variables = SAMPLES["cnn"]()
    export = odmlq.export_tflite(model, INT8, batches(digits.x_calibration, 64), variables=variables,
                                 verify=False)
    qmodel = odmlq.ptq(model, INT8, variables, export.calibration, example_inputs=(digits.x_test[:1],))
    report = odmlq.compare(model, export.plan, export.scales, digits.x_test[:16], variables=variables,
                           tflite=export.tflite, xla=qmodel)
    both = [e for e in report.edges if "xla" in e.runs and "litert" in e.runs]
    assert len(both) >= 3
    for e in both:
        assert e.runs["xla"].sqnr_db >= e.runs["simulate"].sqnr_db - 0.5, e.edge


def test_the_plan_holds_the_litert_constraints(digits):
    model, _, variables = SAMPLES["cnn"]()
    rules = INT8
    x = digits.x_test[:1]
    both = odmlq.plan(model, rules, x, variables=variables)
    xla = odmlq.plan(model, rules, x, variables=variables, target="xla")
    constraints = {e.edge: e.constraint for e in both.edges.values() if e.constraint is not None}
    assert any(isinstance(c, SameAsInput) for c in constraints.values()), constraints
    assert all(e.constraint is None for e in xla.edges.values())
    fused = [e for e in both.edges.values() if e.fused_into is not None]
    assert fused and all(xla.edges[e.edge].spec is not None for e in fused)
    assert odmlq.Plan.from_json(both.to_json()) == both


def test_fixed_and_shared_constraints_are_resolved_per_qtype():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            a = nn.Dense(8, name="a")(x)
            b = nn.Dense(8, name="b")(x)
            return nn.sigmoid(jax.numpy.concatenate([a, b], axis=-1))

    x = np.zeros((1, 4), np.float32)
    for qtype, scale, zero_point in [("int8", 1 / 256, -128), ("int16", 1 / 32768, 0)]:
        p = odmlq.plan(Net(), [Rule(".*", weight_qtype="int8", act_qtype=qtype)], x, target="litert")
        kinds = {p.graph.op(p.graph.edges[e].producer).kind: c for e, c in
                 ((e.edge, e.constraint) for e in p.edges.values()) if c is not None}
        assert kinds["logistic" if "logistic" in kinds else "sigmoid"] == FixedScale(scale, zero_point)
        # int16: written as PAD + ADD, which join exactly at one shared scale.
        assert isinstance(kinds["concatenate"], SharedWithInputs)


def test_the_litert_export_refuses_a_plan_made_for_xla_alone(digits):
    model, _, variables = SAMPLES["mlp"]()
    plan = odmlq.plan(model, INT8, digits.x_test[:1], variables=variables, target="xla")
    with pytest.raises(odmlq.PlanError, match=r"made for the targets \['xla'\].*target='litert'\) or target='both'"):
        odmlq.export_tflite(model, plan, batches(digits.x_calibration, 64), variables=variables)


def test_an_unknown_target_is_named():
    model, x, variables = SAMPLES["mlp"]()
    with pytest.raises(odmlq.PlanError, match=r"target='tpu' is not a target; choose one of \['both', 'litert', 'xla'\]"):
        odmlq.plan(model, INT8, *x, variables=variables, target="tpu")


def test_a_plan_read_from_json_cannot_be_replanned_without_its_tables(digits):
    model, _, variables = SAMPLES["mlp"]()
    plan = odmlq.Plan.from_json(odmlq.plan(model, INT8, digits.x_test[:1], variables=variables).to_json())
    with pytest.raises(odmlq.PlanError, match="read from JSON"):
        plan.replan(INT8)


@pytest.mark.slow
def test_minilm_int8_ptq_matches_the_litert_export_on_every_static_edge():
    """The sample's int8 MiniLM (mixed int8/int16, float LayerNorm and GELU)."""
    from converters.minilm import load_minilm, tokenize
    from samples.minilm_tflite import MASK_BIAS, SCHEMAS, SEQ_LEN, load_sentences

    import dataclasses

    float_model, variables, tokenizer, config = load_minilm()
    model = type(float_model)(dataclasses.replace(config, mask_bias=MASK_BIAS))
    ids, mask = tokenize(tokenizer, load_sentences("calibration_sentences.txt"), seq_len=SEQ_LEN)
    batches_ = [(ids[i:i + 16], mask[i:i + 16]) for i in range(0, len(ids), 16)]
    rules = SCHEMAS["int8+int16"]
    export = odmlq.export_tflite(model, rules, batches_, variables=variables, verify=False,
                                 allow_float_ops=True)
    qmodel = odmlq.ptq(model, rules, variables, export.calibration, example_inputs=(ids[:1], mask[:1]))
    for edge_id, ts in export.scales.edges.items():
        np.testing.assert_array_equal(qmodel.scales.edges[edge_id].scale, ts.scale, err_msg=edge_id)
    test_ids, test_mask = tokenize(tokenizer, load_sentences("sentences.txt")[:4], seq_len=SEQ_LEN)
    run = litert_run(export.tflite, export.plan, export.scales, (test_ids, test_mask))
    # End to end, XLA equals simulate (same ops); LiteRT differs from both by
    # the one-LSB rounding differences of its kernels, which twelve int16
    # layers amplify. Op by op (each fed LiteRT's own inputs) XLA is within
    # 1 LSB of LiteRT, as `verify` checks simulate.
    _, xla_edges = qmodel(test_ids, test_mask, capture=True)
    _, simulated = odmlq.simulate(model, export.plan, export.scales, test_ids, test_mask, variables=variables,
                                  capture=True)
    _, fed = qmodel(test_ids, test_mask, capture=True, feed=run.edges)
    worst_end_to_end, worst_fed, compared = 0.0, 0.0, 0
    for edge_id, ts in export.scales.edges.items():
        lsb = np.asarray(ts.scale, np.float64)
        worst_end_to_end = max(worst_end_to_end, float(np.max(
            np.abs(np.asarray(xla_edges[edge_id], np.float64) - np.asarray(simulated[edge_id])) / lsb)))
        if edge_id not in run.edges:
            continue
        diff = np.abs(np.asarray(fed[edge_id], np.float64) - run.edges[edge_id])
        worst_fed = max(worst_fed, float(np.max(diff / lsb)))
        compared += 1
    assert compared >= 50, compared
    assert worst_end_to_end <= 1.0 + 1e-2, worst_end_to_end  # float32 noise on int16 edges: 1e-2 LSB
    assert worst_fed <= 1.0 + 1e-2, worst_fed
