"""A parameter added to a matmul's output that is not its bias: exported as an ADD.

A bias is fused into the matmul of a weight (int32, at the input's scale times
the weight's, one value per output channel). Two models had a parameter added
where that does not hold, and both ended in a float island, refused with a
message that named the wrong cause (a weight "dequantized at every
invocation"):
- a learned bias on a product of two activations (attention scores plus a
  relative-position bias): LiteRT's BATCH_MATMUL has no bias input;
- a table over positions added to a dense output (one value per position and
  channel, not per channel).
Each is now its own ADD with the parameter a quantized constant: full-integer,
every op within 1 LSB of simulate (verification), and XLA = simulate exactly.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq

R = odmlq.Rule
X = np.random.RandomState(0).randn(32, 6, 4).astype(np.float32)
BATCHES = [X[i:i + 8] for i in range(0, 32, 8)]


class _ScoresPlusBias(nn.Module):
    @nn.compact
    def __call__(self, x):
        q, k = nn.Dense(8, name="q")(x), nn.Dense(8, name="k")(x)
        scores = jnp.einsum("bqd,bkd->bqk", q, k)
        return scores + self.param("relative", nn.initializers.normal(1.0), (6, 6))


class _DensePlusPositions(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, use_bias=False, name="d")(x)
        return h + self.param("positions", nn.initializers.normal(1.0), (6, 8))


@pytest.mark.parametrize("act", ["int8", "int16"])
@pytest.mark.parametrize("module, param", [(_ScoresPlusBias, "relative"), (_DensePlusPositions, "positions")])
def test_a_parameter_that_is_no_bias_is_added_by_its_own_op(module, param, act):
    model = module()
    variables = model.init(jax.random.PRNGKey(0), X[:1])
    rules = [R(".*", weight_qtype="int8", act_qtype=act)]
    plan = odmlq.plan(model, rules, X[:1], variables=variables)
    (adder,) = [op for op in plan.graph.ops if any(o.param == param for o in op.operands)]
    assert adder.kind == "add", adder
    result = odmlq.export_tflite(model, rules, BATCHES, variables=variables, benchmark=False)
    assert result.verification.passed, result.verification
    assert not result.summary.float_islands and result.summary.op_histogram["ADD"] == 1
    xla = odmlq.ptq(model, result.plan, variables, result.calibration)
    simulated = odmlq.simulate(model, result.plan, result.calibration, X, variables=variables)
    np.testing.assert_array_equal(np.asarray(xla(X)), np.asarray(simulated))
