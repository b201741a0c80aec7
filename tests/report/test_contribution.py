"""compare's contributions: what each edge costs the outputs, measured on them.

The model below has an edge whose local SQNR is poor but whose values reach
the output scaled by 0.001 (`b`), and one whose local SQNR is fine but whose
error an exp magnifies (`a`): ranked by local SQNR `b` looks worse; measured
on the outputs `a` carries the error and `b` none, and advice follows the
outputs.
"""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq
from tests.report.test_report import planted_fault, trained_cnn

INT8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


class _Sensitive(nn.Module):
    @nn.compact
    def __call__(self, x):
        a = nn.Dense(16, name="a")(x)  # well scaled, but the output is exp(3a)
        b = nn.Dense(16, name="b")(x)
        return jnp.exp(3.0 * a) + 0.001 * (b * b * b)  # b cubed: heavy tails, a poor local SQNR


@pytest.fixture(scope="module")
def sensitive():
    model = _Sensitive()
    rng = np.random.default_rng(0)
    x, held_out = rng.standard_normal((64, 8)).astype(np.float32), rng.standard_normal((64, 8)).astype(np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    plan = odmlq.plan(model, INT8, x[:1], variables=variables)
    calibration = odmlq.calibrate(model, plan, [x], variables=variables)
    scales = odmlq.compute_scales(plan, calibration, variables)
    report = odmlq.compare(model, plan, scales, held_out, variables=variables, calibration=calibration,
                           rep_dataset=[x], try_fixes=True)
    return model, variables, plan, scales, held_out, report


def test_the_edges_that_carry_the_outputs_error_rank_first(sensitive):
    *_, report = sensitive
    output = report.outputs["output_0"].sqnr_db
    top = report.contributors(2)
    assert {e.edge for e in top} == {"a/exp", "a/add"}, str(report)
    # Each alone costs the outputs nearly all they lose (within 1 dB; measured 0.7).
    assert all(e.alone_sqnr_db <= output + 1.0 for e in top), str(report)
    by_edge = {e.edge: e for e in report.edges}
    b = by_edge["b/mul_2"]
    assert report.edges.index(b) < report.edges.index(by_edge["a/dot_general"])  # worse by local SQNR ...
    assert b.alone_sqnr_db > output + 20.0  # ... yet it costs the outputs under 1% of their error


def test_advice_follows_the_outputs(sensitive):
    *_, report = sensitive
    assert report.advice and all(a.module_path == "a" for a in report.advice), str(report)
    best = max(report.advice, key=lambda a: a.measured.gain_db)
    assert best.measured.gain_db > 10, str(report)  # int16 or float for the exp: +25 dB measured


def test_contributions_read_back_from_json_and_can_be_left_out(sensitive):
    model, variables, plan, scales, held_out, report = sensitive
    again = odmlq.Report.from_json(report.to_json())
    assert [e.edge for e in again.edges] == [e.edge for e in report.edges]
    for key in ("alone_sqnr_db", "float_gain_db"):  # (pytest 9.2's approx takes no tuples of a name and numbers)
        assert [getattr(e, key) for e in again.edges] == pytest.approx([getattr(e, key) for e in report.edges])
    assert "cost the outputs most" in str(report)
    plain = odmlq.compare(model, plan, scales, held_out, variables=variables, contributions=False)
    assert all(e.alone_sqnr_db is None and e.float_gain_db is None for e in plain.edges)
    assert plain.contributors() == () and "cost the outputs most" not in str(plain)
    data = json.loads(plain.to_json())
    assert all("alone_sqnr_db" not in e for e in data["edges"])


def test_a_planted_range_fault_carries_the_outputs_error():
    """conv2's range 10x too small: the group of edges on its scale alone costs
    the outputs what the whole model loses, and in float gains it all back."""
    digits, model, variables, plan, calibration = trained_cnn()
    scales = odmlq.compute_scales(plan, planted_fault(calibration), variables)
    report = odmlq.compare(model, plan, scales, digits.x_test[:64], variables=variables)
    first = report.contributors(1)[0]
    assert first.edge in ("conv2/relu", "conv2/reshape"), str(report)
    assert first.alone_sqnr_db == pytest.approx(report.outputs["output_0"].sqnr_db, abs=1.0)
    assert first.float_gain_db > 20, str(report)


def test_an_error_spread_over_every_edge_gets_advice_for_all_of_them():
    """The zoo's TransformerLM (flax's lm1b model, random weights) loses
    29 dB int8 over many edges: none alone costs its outputs within 3 dB of
    all together, so no single edge is advised. Its error is the int8 rule's
    edges together; their int16x8 twin, measured by try_fixes, gains at
    least 10 dB (measured 10.8: the int8 weights' error stays)."""
    from tests.zoo.models import transformer_lm_linen

    z = transformer_lm_linen()
    batches = z.make_batches(8, 8, 0)
    (held_out,) = z.make_batches(1, 32, 99)
    plan = odmlq.plan(z.model, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")], *z.example_inputs,
                      variables=z.variables)
    calibration = odmlq.calibrate(z.model, plan, batches, variables=z.variables)
    scales = odmlq.compute_scales(plan, calibration, z.variables)
    report = odmlq.compare(z.model, plan, scales, *held_out, variables=z.variables, calibration=calibration,
                           rep_dataset=batches, try_fixes=True)
    assert report.outputs["output_0"].sqnr_db < 30.0
    top = report.contributors(5)
    assert all(e.alone_sqnr_db > report.outputs["output_0"].sqnr_db + 3.0 for e in top)  # no single culprit
    first = report.advice[0]
    assert first.edge == "*" and first.rule.act_qtype == "int16" and first.rule.module_path == ".*", first
    assert first.measured is not None and first.measured.gain_db >= 10.0, first.measured
