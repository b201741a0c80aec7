"""One hook set: where quantization happens is decided once (`PlanHooks`),
and every backend's materializer sees the same edges, constants, converted
inputs and dynamic inputs."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import odmlq
from odmlq.hooks import FakeQuant, PlanHooks

R = odmlq.Rule


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(16, name="a")(x)) * 0.5   # a constant operand
        return nn.Dense(4, name="b")(h)


X = np.random.RandomState(0).randn(32, 8).astype(np.float32)


class _Recording(FakeQuant):
    def __init__(self):
        self.calls = []

    def edge(self, edge_id, x, ts):
        self.calls.append(("edge", edge_id))
        return super().edge(edge_id, x, ts)

    def constant(self, op, index, value, ts):
        self.calls.append(("constant", op.id))
        return super().constant(op, index, value, ts)

    def converted_input(self, op, index, x, ts):
        self.calls.append(("converted", op.id, ts.qtype.name))
        return super().converted_input(op, index, x, ts)

    def dynamic_input(self, op, index, x, spec):
        self.calls.append(("dynamic", op.id))
        return super().dynamic_input(op, index, x, spec)


def _setup(rules):
    model = _Net()
    variables = model.init(jax.random.PRNGKey(0), X[:1])
    plan = odmlq.plan(model, rules, X[:1], variables=variables)
    static = any(e.spec is not None and not e.spec.dynamic for e in plan.edges.values())
    calibration = odmlq.calibrate(model, plan, [X], variables=variables) if static else None
    return model, variables, plan, odmlq.compute_scales(plan, calibration, variables)


def test_every_quantized_place_reaches_the_materializer_once():
    # b computes in int16 and reads a's int8 output through a conversion.
    model, variables, plan, scales = _setup([R("b", weight_qtype="int8", act_qtype="int16"),
                                             R(".*", weight_qtype="int8", act_qtype="int8")])
    recording = _Recording()
    qparams = odmlq.scales.quantized_params(variables, scales)
    PlanHooks(plan, scales, recording).evaluate(plan.graph, qparams, X)
    edges = {c[1] for c in recording.calls if c[0] == "edge"}
    assert edges == set(scales.edges)
    assert [c for c in recording.calls if c[0] == "constant"] == [("constant", op) for op, _ in scales.constants]
    assert [c for c in recording.calls if c[0] == "converted"] == [("converted", "b/dot_general", "int16")]


def test_dynamic_inputs_are_quantized_where_kernels_read_them():
    model, variables, plan, scales = _setup([R(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)])
    recording = _Recording()
    PlanHooks(plan, scales, recording).evaluate(plan.graph, variables, X)
    assert {c[1] for c in recording.calls if c[0] == "dynamic"} == {"a/dot_general", "b/dot_general"}
    assert not [c for c in recording.calls if c[0] == "edge"]  # dynamic edges stay float between kernels


def test_fake_quant_hooks_are_simulate():
    model, variables, plan, scales = _setup([R(".*", weight_qtype="int8", act_qtype="int8")])
    hooks = PlanHooks(plan, scales, capture=True)
    y = hooks.evaluate(plan.graph, odmlq.scales.quantized_params(
        odmlq.scales.folded_weights(plan.graph, variables, scales), scales), X)
    y_sim, captured = odmlq.simulate(model, plan, scales, X, variables=variables, capture=True)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_sim))  # the same ops: bit-exact
    assert set(hooks.captured) == set(captured)


def _xnnpack_qd8(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """XNNPACK's dynamic int8 (qd8) quantizer, in float32 numpy, as its source
    computes it per row (`xnn_f32_qd8_asymmetric_quantization_params`, then
    the convert kernel): codes, step, zero point."""
    f = np.float32
    lo = np.minimum(rows.min(axis=1, keepdims=True), f(0))
    hi = np.maximum(rows.max(axis=1, keepdims=True), f(0))
    inv = np.where(lo == hi, f(1), f(255) / np.where(lo == hi, f(1), hi - lo)).astype(f)
    below, above = (lo * inv).astype(f), (hi * inv).astype(f)
    zero = np.where((f(-128) + below) + (f(127) + above) > 0, f(-128) - below, f(127) - above).astype(f)
    zero = np.rint(np.clip(zero, -128, 127))
    codes = np.clip(np.rint((rows * inv).astype(f)) + zero, -128, 127)
    return codes, (f(1) / inv).astype(f), zero


def test_dynamic_int8_inputs_get_the_codes_xnnpack_computes():
    """A dynamic-range matmul's input, per row, asymmetric: simulate's codes,
    step and zero point are XNNPACK's, bit for bit, on 4096 rows of 256. The
    step times the code divided back is not the same grid: rounding
    ``x / ((hi - lo) / 255)`` instead of ``x * (255 / (hi - lo))`` gives the
    other neighbouring code for some values (counted, so the check can fail)."""
    from odmlq.hooks import dynamic_quantize
    from odmlq.plan import QuantSpec

    rng = np.random.default_rng(0)
    rows = (rng.standard_normal((4096, 256)) * rng.uniform(0.01, 10, (4096, 1))
            + rng.uniform(-3, 3, (4096, 1))).astype(np.float32)
    rows[:4] = np.abs(rows[:4])  # one-sided rows: the range widened to hold 0
    rows[4] = 0.0  # a zero range
    spec = QuantSpec(qtype="int8", symmetric=False, dynamic=True, scale_axes=(0,), calibration=None)
    codes, step, zero = (np.asarray(a) for a in dynamic_quantize(jnp.asarray(rows), spec))
    want_codes, want_step, want_zero = _xnnpack_qd8(rows)
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_array_equal(step, want_step)
    np.testing.assert_array_equal(zero, want_zero)
    spread = np.maximum(rows[5:].max(1, keepdims=True), 0) - np.minimum(rows[5:].min(1, keepdims=True), 0)
    divided = np.clip(np.rint((rows[5:] / (spread / np.float32(255))).astype(np.float32)) + want_zero[5:], -128, 127)
    assert np.count_nonzero(divided != want_codes[5:]) > 0
