"""Quantization-aware training: the same numbers as simulate, gradients that
pass the rounding, tracked ranges, and an export that matches the trained model."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import odmlq
from odmlq.scales import TensorScale
from odmlq.training._straight import straight, traced_weight_scale
from tests._runs import litert_rows


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(8, (3, 3), name="conv1")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=True, name="bn1")(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Conv(8, (3, 3), feature_group_count=8, name="depthwise")(x))
        x = x.reshape((x.shape[0], -1))
        return nn.Dense(4, name="head")(x)


def _setup(seed=0):
    model = CNN()
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(96, 8, 8, 1)).astype(np.float32)
    variables = model.init(jax.random.key(seed), x[:1])
    # A BatchNorm with statistics of its own, so the fold is not the identity.
    stats = variables["batch_stats"]["bn1"]
    variables = {**variables, "batch_stats": {"bn1": {
        "mean": jnp.asarray(rng.normal(size=stats["mean"].shape), jnp.float32) * 0.1,
        "var": jnp.asarray(rng.uniform(0.5, 2.0, size=stats["var"].shape), jnp.float32)}}}
    return model, variables, x


def _batches(x, size=16):
    return [x[i:i + size] for i in range(0, len(x), size)]


RULES = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


def _trained(q, x, steps=20, lr=1e-2):
    """Adam steps fitting one batch to a random target, the ranges held at `q.stats`."""
    target = np.random.default_rng(1).normal(size=(len(x), 4)).astype(np.float32)
    params, rest = q.params["params"], {k: v for k, v in q.params.items() if k != "params"}
    opt = optax.adam(lr)
    state = opt.init(params)

    @jax.jit
    def step(params, state, xb, yb):
        def loss(p):
            return jnp.mean((q.apply({"params": p, **rest}, q.stats, xb) - yb) ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for _ in range(steps):
        params, state, value = step(params, state, x[:32], target[:32])
        losses.append(float(value))
    return {"params": params, **rest}, losses


def test_step_zero_is_ptq_exactly():
    model, variables, x = _setup()
    nearest = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", weight_algorithm=odmlq.Nearest())]
    q = odmlq.qat(model, nearest, _batches(x[:64]), variables=variables, progress=False)
    plan = odmlq.plan(model, nearest, x[:1], variables=variables)
    calibration = odmlq.calibrate(model, plan, _batches(x[:64]), variables=variables, progress=False)
    ptq = odmlq.simulate(model, plan, calibration, x[64:], variables=variables)
    # The same integers: BatchNorm folded, ranges and weight scales as PTQ's (0 LSB).
    np.testing.assert_array_equal(np.asarray(q.apply(q.params, q.stats, x[64:])), np.asarray(ptq))


def test_training_starts_from_the_rules_rounded_weights():
    model, variables, x = _setup()
    q = odmlq.qat(model, RULES, _batches(x[:64]), variables=variables, progress=False)
    plan = odmlq.plan(model, RULES, x[:1], variables=variables)
    calibration = odmlq.calibrate(model, plan, _batches(x[:64]), variables=variables, progress=False)
    gptq = odmlq.compute_scales(plan, calibration, variables)
    assert set(gptq.weight_values) == {"conv1/kernel", "depthwise/kernel", "head/kernel"}
    folded = odmlq.graph.flat_params(odmlq.graph.fold_params(q.plan.graph, q.params))
    for param, rounded in gptq.weight_values.items():
        # conv1's BatchNorm is folded back out of the start and in again: float32 rounding only.
        np.testing.assert_allclose(np.asarray(folded[param]), rounded, rtol=1e-6, atol=1e-7)
        scale = gptq.weights[param].scale
        assert np.max(np.abs(np.round(rounded / scale) * scale - rounded)) <= 1e-6 * np.max(np.abs(rounded))
    # Its first step computes GPTQ's model (a channel whose largest weight GPTQ
    # rounded down gets a finer grid, here none).
    ptq = np.asarray(odmlq.simulate(model, plan, gptq, x[64:], variables=variables))
    np.testing.assert_allclose(np.asarray(q.apply(q.params, q.stats, x[64:])), ptq, rtol=0, atol=1e-5)


def test_traced_weight_scales_equal_compute_scales():
    w = np.random.default_rng(0).normal(size=(256, 12)).astype(np.float32)
    w[3, 5] = 40.0  # an outlier channel
    for rule in (odmlq.Rule(".*", weight_qtype="int8"),
                 odmlq.Rule(".*", weight_qtype="int8", weight_granularity=odmlq.PerTensor()),
                 odmlq.Rule(".*", weight_qtype="int4", weight_granularity=odmlq.PerBlock(64)),
                 odmlq.Rule(".*", weight_qtype="int8", weight_calibration=odmlq.AbsMax(clip_ratio=0.5))):
        model = nn.Dense(12)
        variables = {"params": {"kernel": jnp.asarray(w), "bias": jnp.zeros(12)}}
        plan = odmlq.plan(model, [dataclass_nearest(rule)], np.ones((1, 256), np.float32), variables=variables)
        host = odmlq.compute_scales(plan, None, variables).weights["kernel"]
        spec = plan.weight_specs()["kernel"]
        traced = jax.jit(lambda v: traced_weight_scale(v, spec, host).scale)(w)
        np.testing.assert_array_equal(np.asarray(traced), host.scale)


def dataclass_nearest(rule):
    import dataclasses

    return dataclasses.replace(rule, weight_algorithm=odmlq.Nearest())


def test_gradient_passes_inside_the_grid_and_stops_outside():
    ts = TensorScale(qtype="int8", scale=np.array([[0.1]], np.float32), zero_point=np.array([[-28]], np.int32))
    x = jnp.array([[-20.0, -1.03, 0.0, 0.26, 15.0, 50.0]])
    value = straight(x, ts)
    np.testing.assert_array_equal(np.asarray(value), np.asarray(ts.fake_quant(x)))
    grad = jax.grad(lambda v: jnp.sum(straight(v, ts) * jnp.arange(1.0, 7.0)))(x)
    # The grid spans [(-128 + 28) * 0.1, (127 + 28) * 0.1] = [-10, 15.5].
    np.testing.assert_array_equal(np.asarray(grad), [[0.0, 2.0, 3.0, 4.0, 5.0, 0.0]])


def test_stats_are_read_on_the_host_and_calibrated_afresh_on_request():
    model, variables, x = _setup()
    q = odmlq.qat(model, RULES, _batches(x[:64]), variables=variables, progress=False)
    with pytest.raises(odmlq.PlanError, match="close over them"):
        jax.jit(lambda p, s, b: q.apply(p, s, b))(q.params, q.stats, x[:4])
    trained, _ = _trained(q, x)
    fresh = q.calibrate(trained, _batches(x[:64]), progress=False)
    assert set(fresh) == set(q.stats)
    # The trained weights move the activations: the head's range is calibrated anew.
    assert float(fresh["head/dot_general"]["max"]) != float(q.stats["head/dot_general"]["max"])
    plan = odmlq.plan(model, RULES, x[:1], variables=trained)
    calibration = odmlq.calibrate(model, plan, _batches(x[:64]), variables=trained, progress=False)
    lo, hi = calibration.range("head/dot_general", "int8", symmetric=False)
    assert float(fresh["head/dot_general"]["min"]) == float(lo) and float(fresh["head/dot_general"]["max"]) == float(hi)


def test_training_lowers_the_loss_and_exports_what_it_trained():
    model, variables, x = _setup()
    q = odmlq.qat(model, RULES, _batches(x[:64]), variables=variables, progress=False)
    trained, losses = _trained(q, x)
    assert losses[-1] < 0.7 * losses[0], losses
    stats = q.stats
    exported = q.export_tflite(trained, stats, rep_dataset=_batches(x[64:]), progress=False)
    # The export's scales are the trained model's: simulate with them is apply, exactly.
    held_out = x[80:]
    reference = np.asarray(q.apply(trained, stats, held_out))
    np.testing.assert_array_equal(
        np.asarray(odmlq.simulate(model, q.plan, exported.scales, held_out, variables=trained)), reference)
    # Verified op by op on export (1 LSB); the outputs, 1 LSB of the output scale.
    lsb = float(np.max(exported.scales.edges["head/dot_general"].scale))
    assert np.max(np.abs(litert_rows(exported.tflite, held_out) - reference)) <= lsb * 1.001


def test_ptq_of_the_trained_model_matches_apply():
    model, variables, x = _setup()
    q = odmlq.qat(model, RULES, _batches(x[:64]), variables=variables, progress=False)
    trained, _ = _trained(q, x, steps=4)
    stats = q.stats
    quantized = q.ptq(trained, stats, example_inputs=(x[:1],))
    reference = np.asarray(q.apply(trained, stats, x[80:]))
    lsb = float(np.max(q.scales(trained, stats).edges["head/dot_general"].scale))
    assert np.max(np.abs(np.asarray(quantized(x[80:])) - reference)) <= lsb * 1.001


def test_rules_qat_cannot_train_with_are_refused():
    model, variables, x = _setup()
    with pytest.raises(odmlq.RuleError, match="absolute maximum"):
        odmlq.qat(model, [odmlq.Rule(".*", weight_qtype="int8", weight_calibration=odmlq.MSE(),
                                     weight_granularity=odmlq.PerTensor())],
                  _batches(x[:32]), variables=variables, progress=False)
    with pytest.raises(odmlq.PlanError, match="at least one batch"):
        odmlq.qat(model, RULES, [], variables=variables)


def test_nnx_modules_train_as_state_and_export():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
            self.head = nnx.Linear(4 * 8 * 8, 3, rngs=rngs)

        def __call__(self, x):
            return self.head(nnx.relu(self.conv(x)).reshape((x.shape[0], -1)))

    model, x = Net(nnx.Rngs(0)), np.random.default_rng(0).normal(size=(48, 8, 8, 1)).astype(np.float32)
    q = odmlq.qat(model, RULES, _batches(x[:32]), progress=False)
    assert isinstance(q.params, nnx.State)
    grads = jax.grad(lambda p: jnp.sum(q.apply(p, q.stats, x[:8]) ** 2))(q.params)
    assert float(jnp.linalg.norm(odmlq.graph.flat_params(grads)["head/kernel"])) > 0
    exported = q.export_tflite(q.params, q.stats, rep_dataset=_batches(x[32:]), progress=False)
    lsb = float(np.max(exported.scales.edges[q.plan.graph.outputs[0]].scale))
    assert np.max(np.abs(litert_rows(exported.tflite, x[32:]) - np.asarray(q.apply(q.params, q.stats, x[32:])))) \
        <= lsb * 1.001


def test_bias_correction_is_carried_into_the_start():
    model, variables, x = _setup()
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8",
                        weight_algorithm=odmlq.GPTQ(bias_correction=True))]
    plan = odmlq.plan(model, rules, x[:1], variables=variables)
    calibration = odmlq.calibrate(model, plan, _batches(x[:64]), variables=variables, progress=False)
    scales = odmlq.compute_scales(plan, calibration, variables)
    assert "conv1/conv" in scales.shifts  # the BatchNorm'd convolution's correction
    ptq = np.asarray(odmlq.simulate(model, plan, scales, x[64:], variables=variables))
    q = odmlq.qat(model, rules, _batches(x[:64]), variables=variables, progress=False)
    start = np.asarray(q.apply(q.params, q.stats, x[64:]))
    without = odmlq.qat(model, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")], _batches(x[:64]),
                        variables=variables, progress=False)
    # The correction sits in bn1's offset: the start computes PTQ's model (float32 rounding
    # of the folded bias may move an edge by 1 LSB), not the uncorrected one.
    lsb = float(np.max(q.scales(q.params, q.stats).edges["head/dot_general"].scale))
    assert np.max(np.abs(start - ptq)) <= 2 * lsb
    assert not np.allclose(np.asarray(q.params["params"]["bn1"]["bias"]),
                           np.asarray(without.params["params"]["bn1"]["bias"]))
