"""A float op's constant operand computed by steps (transformers' Marian and
Pegasus: sinusoidal positions, a constant table taken at constant positions
with ``jnp.take``, whose bounds check is a REDUCE_ALL and a SELECT_V2).

Every backend reads the value folded at trace time, as it already did for a
quantized constant. Before, the float ops of the dynamic-range and weight-only
schemas computed the rows again at every invocation; in Marian's and
Pegasus' dynamic-range files litert-converter also quantized them (1024 values
or more) and dequantized them at every invocation, which the export refused.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq

R = odmlq.Rule
SCHEMAS = {
    "int8": ([R(".*", weight_qtype="int8", act_qtype="int8")],
             {"QUANTIZE": 1, "ADD": 1, "FULLY_CONNECTED": 2, "DEQUANTIZE": 1}),
    "dynamic": ([R(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)],
                {"ADD": 1, "FULLY_CONNECTED": 2}),
    "weight_only": ([R(".*", weight_qtype="int8")], {"DEQUANTIZE": 2, "ADD": 1, "FULLY_CONNECTED": 2}),
}


def _sinusoidal(n: int, d: int) -> np.ndarray:
    angles = np.arange(n)[:, None] / np.power(10000, 2 * (np.arange(d)[None] // 2) / d)
    return np.where(np.arange(d) % 2 == 0, np.sin(angles), np.cos(angles)).astype(np.float32)


class SinusoidalPositions(nn.Module):
    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        x = x + jnp.take(jnp.asarray(_sinusoidal(64, d)), positions, axis=0)
        return nn.Dense(d)(nn.relu(nn.Dense(d)(x)))


@pytest.mark.parametrize("schema", list(SCHEMAS))
def test_positions_taken_from_a_constant_table_are_one_constant_in_every_schema(schema):
    rules, histogram = SCHEMAS[schema]
    x = np.random.default_rng(0).normal(size=(8, 16, 64)).astype(np.float32)  # 16 x 64 rows: 1024 values
    model = SinusoidalPositions()
    variables = model.init(jax.random.key(0), x[:1])
    result = odmlq.export_tflite(model, rules, [x], variables=variables, benchmark=False, progress=False)
    assert result.verification.passed, str(result.verification)
    # No REDUCE_ALL, SELECT_V2 or RESHAPE recomputing the rows; the ADD reads them as a constant.
    assert result.summary.op_histogram == histogram, result.summary.op_histogram
    reference = np.asarray(model.apply(variables, x))
    simulated = np.asarray(odmlq.simulate(model, result.plan, result.calibration, x, variables=variables))
    # The folded rows are the rows: simulate is within int8's usual distance of float.
    assert 10 * np.log10(np.sum(reference ** 2) / np.sum((reference - simulated) ** 2)) > 30


class _PlusComputed(nn.Module):
    """A dense layer over a sequence plus a constant its steps compute (an iota,
    a linspace), after a TANH or not."""

    constant: str = "arange"
    tanh: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, name="d")(x)
        h = jnp.tanh(h) if self.tanh else h
        c = jnp.arange(8, dtype=jnp.float32) / 8 if self.constant == "arange" else jnp.linspace(-1.0, 1.0, 8)
        return h + c


@pytest.mark.parametrize("act", ["int8", "int16"])
@pytest.mark.parametrize("constant, tanh", [("arange", False), ("linspace", False), ("arange", True)])
def test_a_constant_computed_by_steps_is_put_on_its_grid_before_conversion(constant, tanh, act):
    """int16: the constant is broadcast to the ADD's shape (litert-converter takes
    int16 ADD operands of one shape). Traced, its broadcast and rounding reached
    the converter as ops and 'tfl.add' failed, naming no op; put on its grid on
    the host, it is one int16 constant. Verified within 1 LSB per op (the TANH's
    own tolerance in int16), no float op, and XLA = simulate."""
    model = _PlusComputed(constant, tanh)
    x = np.random.RandomState(0).randn(32, 6, 4).astype(np.float32)
    variables = model.init(jax.random.PRNGKey(0), x[:1])
    rules = [R(".*", weight_qtype="int8", act_qtype=act)]
    result = odmlq.export_tflite(model, rules, [x[i:i + 8] for i in range(0, 32, 8)], variables=variables,
                                 benchmark=False)
    assert result.verification.passed, result.verification
    assert not result.summary.float_islands and result.summary.op_histogram["ADD"] == 1
    xla = odmlq.ptq(model, result.plan, variables, result.calibration)
    simulated = odmlq.simulate(model, result.plan, result.calibration, x, variables=variables)
    np.testing.assert_array_equal(np.asarray(xla(x)), np.asarray(simulated))
