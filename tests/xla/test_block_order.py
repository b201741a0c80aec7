"""simulate and XLA add a blockwise weight's scaled block sums in one order.

A matmul of dynamically quantized int8 inputs and an int4 weight with one
scale per block of 32 along the contracted axis sums each block's codes
exactly; the scaled block sums are then added one block after another, from
the first, by one function both backends call
(`odmlq.qarray.kernels.block_sums_in_order`). Their outputs are therefore
equal bit for bit (0 ulp: the tolerance is none, because any difference in
the order or the fusing of these additions shows up as a last-bit
difference in some of the outputs), at a decode step's single row, where
XLA's kernel runs the weight in several row blocks, and at a prefill's 64.
"""

import jax
import numpy as np
import pytest
import flax.linen as nn

import odmlq


class _Dense(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.features, name="dense")(x)


@pytest.mark.parametrize("target", ["xla", "litert"])
@pytest.mark.parametrize("rows", [1, 64])
def test_simulate_and_xla_add_block_sums_alike(target, rows):
    rng = np.random.default_rng(rows)
    k, n = 1024, 256
    model = _Dense(n)
    # Heavy tails and uneven columns: block sums whose scaled additions round.
    def draw(m):
        return (rng.standard_t(2, size=(m, k)) * rng.uniform(0.1, 5, size=(1, k))).astype(np.float32)

    x = draw(rows)
    variables = model.init(jax.random.key(1), x)
    rules = [odmlq.Rule(".*", weight_qtype="int4", weight_granularity=odmlq.PerBlock(32), act_qtype="int8",
                        act_dynamic=True, weight_algorithm=odmlq.Nearest())]
    plan = odmlq.plan(model, rules, x, variables=variables, target=target)
    calibration = odmlq.calibrate(model, plan, [x], variables=variables)
    xla = odmlq.ptq(model, plan, variables, calibration)
    for _ in range(3):
        x = draw(rows)
        np.testing.assert_array_equal(np.asarray(jax.jit(xla.apply)(xla.params, x)),
                                      np.asarray(odmlq.simulate(model, plan, calibration, x, variables=variables)))
