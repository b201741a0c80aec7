"""A sum of two BatchNorm'd branches trades per-channel offsets (`Plan.balanced_sums`).

The model is a residual block with a projection shortcut, its BatchNorm
biases pulling channels of the two branches in opposite directions (as
trained ResNets do), so that each branch's per-tensor range is mostly offset.

Tolerances: the shifted float run reorders float32 additions (rtol 1e-5);
LiteRT is checked op by op by the export's own verification (1 LSB); XLA's
full-integer outputs are on the output edge's grid like simulate's: 1 LSB.
The narrowing asserted (steps 1.5x smaller, edge errors 3 dB smaller) is
what the offsets built in allow; the output, whose error comes mostly from
the other edges here, must lose no more than 0.5 dB.
"""


import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq
from odmlq.calibration import Calibration, channel_key
from odmlq.graph import GraphCache, params_for
from odmlq.report._runs import float_run

RNG = np.random.RandomState(0)
X = RNG.rand(64, 8, 8, 3).astype(np.float32)
HELD = RNG.rand(16, 8, 8, 3).astype(np.float32)
INT8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


class Block(nn.Module):
    sub: bool = False
    shortcut_out: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Conv(8, (3, 3), name="stem")(x))
        a = nn.BatchNorm(use_running_average=True, name="bn_a")(
            nn.Conv(16, (3, 3), use_bias=False, name="conv_a")(h))
        b = nn.BatchNorm(use_running_average=True, name="bn_b")(
            nn.Conv(16, (1, 1), use_bias=False, name="conv_b")(h))
        y = nn.relu(a - b if self.sub else a + b)
        out = nn.Dense(4, name="head")(jnp.mean(y, axis=(1, 2)))
        return (out, b) if self.shortcut_out else out


def _model(**kw):
    model = Block(**kw)
    variables = flax.core.unfreeze(model.init(jax.random.PRNGKey(0), X[:1]))
    offsets = 3.0 * np.random.RandomState(1).randn(16).astype(np.float32)
    sign = -1.0 if kw.get("sub") else 1.0
    variables["params"]["bn_a"]["bias"] = jnp.asarray(offsets)
    variables["params"]["bn_b"]["bias"] = jnp.asarray(-sign * offsets + 0.3 * np.random.RandomState(2).randn(16),
                                                      jnp.float32)
    return model, variables


def _quantized(model, variables, rules=INT8, drop_channels=False):
    plan = odmlq.plan(model, rules, X[:1], variables=variables)
    calibration = odmlq.calibrate(model, plan, [X[i:i + 16] for i in range(0, 64, 16)], variables=variables)
    if drop_channels:
        calibration = Calibration({k: calibration[k] for k in calibration if not k.endswith("#channels")})
    scales = odmlq.compute_scales(plan, calibration, params_for(model, variables, "test"))
    return plan, calibration, scales


def _sqnr_db(reference, other) -> float:
    reference, other = np.asarray(reference, np.float64), np.asarray(other, np.float64)
    return float(10 * np.log10(np.sum(reference**2) / max(np.sum((reference - other) ** 2), 1e-30)))


@pytest.mark.parametrize("sub", [False, True], ids=["add", "sub"])
def test_a_projection_shortcut_is_balanced(sub):
    model, variables = _model(sub=sub)
    plan, calibration, scales = _quantized(model, variables)
    (balanced,) = plan.balanced_sums
    assert [plan.graph.op(o).module_path for o in balanced.ops] == ["conv_a", "conv_b"]
    assert balanced.sign == (-1.0 if sub else 1.0)
    assert all(channel_key(e) in calibration for e in balanced.edges)
    shift_a, shift_b = (scales.shifts[o] for o in balanced.ops)
    assert shift_a.shape == (16,) and np.max(np.abs(shift_a)) > 1.0
    np.testing.assert_array_equal(shift_b, -balanced.sign * shift_a)  # the sum is kept

    # The shifted float model computes the float model's outputs.
    graph = GraphCache(model, plan, variables).graph_for((HELD,))
    outputs, edges = float_run(graph, params_for(model, variables, "test"), (HELD,), scales.shifts)
    np.testing.assert_allclose(outputs[0], model.apply(variables, HELD), rtol=1e-5, atol=1e-5)

    # Both edges get finer steps, and the quantized model is closer to float.
    _, _, plain = _quantized(model, variables, drop_channels=True)
    assert plain.shifts == {}
    for edge_id in balanced.edges:
        assert float(np.max(scales.edges[edge_id].scale)) < float(np.max(plain.edges[edge_id].scale)) / 1.5
    _, plain_floats = float_run(graph, params_for(model, variables, "test"), (HELD,))
    _, got = odmlq.simulate(model, plan, scales, HELD, variables=variables, capture=True)
    _, got_plain = odmlq.simulate(model, plan, plain, HELD, variables=variables, capture=True)
    for edge_id in balanced.edges:  # their error, not their SQNR: the offsets were signal
        error = np.mean((np.asarray(got[edge_id]) - edges[edge_id]) ** 2)
        plain_error = np.mean((np.asarray(got_plain[edge_id]) - plain_floats[edge_id]) ** 2)
        assert 10 * np.log10(plain_error / error) > 3.0, (edge_id, error, plain_error)
    reference = model.apply(variables, HELD)
    balanced_db = _sqnr_db(reference, odmlq.simulate(model, plan, scales, HELD, variables=variables))
    plain_db = _sqnr_db(reference, odmlq.simulate(model, plan, plain, HELD, variables=variables))
    # Elsewhere (stem, head) dominates this block's output error: no loss there.
    assert balanced_db > plain_db - 0.5, (balanced_db, plain_db)


def test_the_report_lines_balanced_edges_up_with_shifted_float():
    model, variables = _model()
    plan, _, scales = _quantized(model, variables)
    report = odmlq.compare(model, plan, scales, HELD, variables=variables)
    for edge_id in plan.balanced_sums[0].edges:
        (edge,) = [e for e in report.edges if e.edge == edge_id]
        assert edge.runs["simulate"].sqnr_db > 30.0, (edge_id, edge.runs["simulate"])


def test_xla_and_litert_read_the_shifts(tmp_path):
    model, variables = _model()
    plan, calibration, scales = _quantized(model, variables)
    assert scales.shifts
    simulated = np.asarray(odmlq.simulate(model, plan, scales, HELD, variables=variables))
    qmodel = odmlq.ptq(model, plan, variables, calibration)
    step = float(np.max(scales.edges[plan.graph.outputs[0]].scale))
    np.testing.assert_allclose(np.asarray(qmodel.apply(qmodel.params, HELD)), simulated, atol=1.01 * step)

    # export_tflite verifies LiteRT against simulate op by op (1 LSB), the
    # balanced edges included, and raises VerificationError otherwise.
    path = tmp_path / "block.tflite"
    odmlq.export_tflite(model, INT8, [X[i:i + 16] for i in range(0, 64, 16)], path, variables=variables)
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=str(path))
    interpreter.allocate_tensors()
    inp, out = interpreter.get_input_details()[0], interpreter.get_output_details()[0]
    reference = model.apply(variables, HELD)
    rows = []
    for image in HELD:
        interpreter.set_tensor(inp["index"], image[None])
        interpreter.invoke()
        rows.append(interpreter.get_tensor(out["index"])[0])
    assert _sqnr_db(reference, np.stack(rows)) > 30.0


@pytest.mark.parametrize("case", ["read_elsewhere", "percentile", "weights_float"])
def test_what_is_not_balanced(case):
    if case == "read_elsewhere":  # the shortcut is also a model output: a shift would change it
        model, variables = _model(shortcut_out=True)
        rules = INT8
    elif case == "percentile":  # only MinMax ranges are exact from per-channel extremes
        model, variables = _model()
        rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8",
                            act_calibration=odmlq.Percentile(99.9))]
    else:  # no quantized kernel: the BatchNorm is not folded, no bias to carry a shift
        model, variables = _model()
        rules = [odmlq.Rule("conv_b", weight_qtype=None, act_qtype="int8"), *INT8]
    plan, calibration, scales = _quantized(model, variables, rules)
    assert plan.balanced_sums == ()
    assert scales.shifts == {}
    assert not any(k.endswith("#channels") for k in calibration)


def test_saved_calibrations_keep_the_per_channel_ranges(tmp_path):
    model, variables = _model()
    plan, calibration, scales = _quantized(model, variables)
    calibration.save(tmp_path / "calibration.npz")
    loaded = odmlq.Calibration.load(tmp_path / "calibration.npz")
    again = odmlq.compute_scales(plan, loaded, params_for(model, variables, "test"))
    assert sorted(again.shifts) == sorted(scales.shifts)
    for op_id, shift in scales.shifts.items():
        np.testing.assert_array_equal(again.shifts[op_id], shift)


@pytest.mark.parametrize("method", [odmlq.MinMax(), odmlq.MinMax(headroom=True)], ids=["minmax", "headroom"])
def test_shifted_statistics_are_those_of_the_shifted_tensor(method):
    """What the shifted edge would have been observed as: counts, extremes and
    the most extreme values exact, sums within float64 rounding (rtol 1e-12)."""
    from odmlq.calibration import observe
    from odmlq.scales._balance import shifted_statistics

    x = RNG.randn(40, 5, 6)
    shift = RNG.randn(6)
    per_channel = observe(method, None, x, keep_axes=(2,))
    direct = observe(method, None, x + shift)
    moved = shifted_statistics(per_channel, shift)
    for field in ("count", "min", "max", "batches", "top", "bottom"):
        if getattr(direct, field) is None:
            assert getattr(moved, field) is None
            continue
        np.testing.assert_array_equal(getattr(moved, field), getattr(direct, field), err_msg=field)
    for field in ("sum", "sum_of_squares"):
        np.testing.assert_allclose(getattr(moved, field), getattr(direct, field), rtol=1e-12, err_msg=field)
