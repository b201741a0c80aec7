"""simulate: the reference semantics, from scales or straight from a calibration;
capture and feed are what op-by-op verification is built on."""

import flax.linen as nn
import jax
import numpy as np

import odmlq

X = np.random.RandomState(0).randn(16, 8).astype(np.float32)
INT8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="b")(nn.relu(nn.Dense(16, name="a")(x)))


def _setup():
    model = Mlp()
    variables = model.init(jax.random.PRNGKey(0), X[:1])
    plan = odmlq.plan(model, INT8, X[:1], variables=variables)
    calibration = odmlq.calibrate(model, plan, [X], variables=variables)
    return model, variables, plan, calibration


def test_a_calibration_gives_what_its_scales_give():
    model, variables, plan, calibration = _setup()
    scales = odmlq.compute_scales(plan, calibration, variables)
    np.testing.assert_array_equal(np.asarray(odmlq.simulate(model, plan, calibration, X, variables=variables)),
                                  np.asarray(odmlq.simulate(model, plan, scales, X, variables=variables)))


def test_every_quantized_edge_is_on_its_grid():
    model, variables, plan, calibration = _setup()
    scales = odmlq.compute_scales(plan, calibration, variables)
    _, edges = odmlq.simulate(model, plan, scales, X, variables=variables, capture=True)
    for edge_id, ts in scales.edges.items():
        codes = np.asarray(edges[edge_id]) / np.asarray(ts.scale) + np.asarray(ts.zero_point)
        np.testing.assert_allclose(codes, np.round(codes), atol=1e-3, err_msg=edge_id)  # float32 noise


def test_feed_runs_each_op_on_the_fed_tensors():
    model, variables, plan, calibration = _setup()
    scales = odmlq.compute_scales(plan, calibration, variables)
    hidden = "a/relu"
    fed = {hidden: np.zeros((16, 16), np.float32)}
    y, edges = odmlq.simulate(model, plan, scales, X, variables=variables, capture=True, feed=fed)
    assert np.any(np.asarray(edges[hidden]) != 0)  # captured before the feed replaces it
    bias = np.asarray(variables["params"]["b"]["bias"])
    # b reads zeros: its output is its bias (rounded to its int32 grid, then to b's edge grid).
    lsb = float(np.asarray(scales.edges["b/dot_general"].scale).reshape(-1)[0])
    np.testing.assert_allclose(np.asarray(y), np.broadcast_to(bias, (16, 4)), atol=lsb)


def test_a_fed_program_with_feeding_off_gives_the_unfed_run_bit_for_bit():
    """verify compiles one program per row shape: the fed run's, with feeding
    switched off for the end-to-end outputs. Off, no fed value may leak in."""
    from odmlq.simulate import Simulator

    model, variables, plan, calibration = _setup()
    scales = odmlq.compute_scales(plan, calibration, variables)
    simulator = Simulator(model, plan, scales, variables=variables)
    fed = {"a/relu": np.zeros((16, 16), np.float32)}
    plain = np.asarray(simulator(X))
    fed_y, _ = simulator(X, capture=True, feed=fed)
    off_y, off_edges = simulator(X, capture=True, feed=fed, use_feed=False)
    assert not np.array_equal(np.asarray(fed_y), plain)  # the feed changes the outputs
    np.testing.assert_array_equal(np.asarray(off_y), plain)
    _, edges = simulator(X, capture=True)
    for edge_id, value in edges.items():
        np.testing.assert_array_equal(np.asarray(off_edges[edge_id]), np.asarray(value), err_msg=edge_id)
    assert len(simulator._jitted) == 3  # plain, fed (on and off), captured
