"""A quantized matmul in the reference semantics sums its integer codes exactly
(`odmlq._sums`), as integer kernels do, so simulate and the XLA backend's
integer matmuls compute the same numbers and a near tie goes the same way on
both."""

import string

import flax.linen as nn
import jax
import numpy as np
import pytest

import odmlq
from odmlq import _sums
from odmlq.qtypes import qtype

RNG = np.random.default_rng(0)
EPS = np.finfo(np.float32).eps


def _einsum_spec(a_ndim, b_ndim, dn):
    (lc, rc), (lb, rb) = dn
    left = list(string.ascii_lowercase[:a_ndim])
    right = list(string.ascii_lowercase[a_ndim:a_ndim + b_ndim])
    for x, y in list(zip(lc, rc)) + list(zip(lb, rb)):
        right[y] = left[x]
    out = ([left[i] for i in lb] + [left[i] for i in range(a_ndim) if i not in lc and i not in lb]
           + [right[i] for i in range(b_ndim) if i not in rc and i not in rb])
    return "".join(left) + "," + "".join(right) + "->" + "".join(out)


def _operand(shape, scale_shape, bits, block_axis=None, block_size=None):
    scale = RNG.uniform(0.01, 0.1, scale_shape).astype(np.float32)
    top = 2 ** (bits - 1) - 1
    codes = RNG.integers(-top, top + 1, shape)
    full = scale if block_axis is None else np.repeat(scale, block_size, axis=block_axis)
    values = (codes * full).astype(np.float32)
    return values, _sums.grid(qtype(f"int{bits}"), scale, None, shape, block_axis, block_size), codes * full.astype(
        np.float64)


LAYOUTS = {
    # name: (a shape, a scale shape, b shape, b scale shape, dimension numbers, b block axis/size, a block)
    "dense": ((4, 512), (4, 1), (512, 64), (1, 64), (((1,), (0,)), ((), ())), None, None),
    "weight on the left": ((512, 64), (1, 64), (4, 512), (4, 1), (((0,), (1,)), ((), ())), None, None),
    "3-D input": ((2, 3, 256), (2, 3, 1), (256, 16), (1, 16), (((2,), (0,)), ((), ())), None, None),
    "attention scores": ((2, 4, 8, 64), (1, 1, 1, 1), (2, 4, 16, 64), (1, 1, 1, 1),
                         (((3,), (3,)), ((0, 1), (0, 1))), None, None),
    "int4 blocks of 32": ((4, 512), (4, 1), (512, 64), (16, 64), (((1,), (0,)), ((), ())), (0, 32), None),
    "blocks on the left": ((512, 64), (16, 64), (3, 5, 512), (3, 5, 1), (((0,), (2,)), ((), ())), None, (0, 32)),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_exact_sums_then_the_scales(name):
    a_shape, sa, b_shape, sb, dn, b_blocks, a_blocks = LAYOUTS[name]
    a, ga, a64 = _operand(a_shape, sa, 8, *(a_blocks or (None, None)))
    b, gb, b64 = _operand(b_shape, sb, 4 if b_blocks else 8, *(b_blocks or (None, None)))
    compute = _sums.integer_sums(lambda x, y: jax.lax.dot_general(x, y, dn), [a, b], {0: ga, 1: gb}, 1)
    got = np.asarray(jax.jit(compute)(a, b)[0])
    # The quantized matmul: codes times scales, in float64.
    exact = np.einsum(_einsum_spec(a.ndim, b.ndim, dn), a64, b64)
    summed = np.asarray(jax.lax.dot_general(a, b, dn))
    # The codes' sums are exact; two scale multiplies round (2 ulps), and a
    # blockwise weight's block sums add one rounding per block of the row.
    if a_blocks or b_blocks:
        bound = (2 + 512 // 32) * EPS * np.einsum(_einsum_spec(a.ndim, b.ndim, dn), np.abs(a64), np.abs(b64))
    else:
        bound = 2 * EPS * np.abs(exact)
    assert np.all(np.abs(got - exact) <= bound)
    # Summing dequantized float32 values is further off (the difference this closes).
    assert np.max(np.abs(got - exact)) < np.max(np.abs(summed - exact))


def test_a_transposed_weight_is_still_summed_on_its_codes():
    # A tied embedding read as the output projection: x @ table.T.
    x, gx, x64 = _operand((4, 256), (4, 1), 8)
    table, gt, t64 = _operand((64, 256), (64, 1), 8)
    compute = _sums.integer_sums(lambda x, t: x @ t.T, [x, table], {0: gx, 1: gt}, 1)
    got = np.asarray(compute(x, table)[0])
    np.testing.assert_allclose(got, x64 @ t64.T, rtol=2 * EPS, atol=0)  # two roundings: the scales


def test_operands_off_a_grid_keep_the_float_matmul():
    x, gx, _ = _operand((4, 64), (4, 1), 8)
    compute = lambda x, w: x @ w  # noqa: E731
    assert _sums.integer_sums(compute, [x, x.T], {0: gx}, 1) is compute
    int16 = _sums.grid(qtype("int16"), np.ones((4, 1), np.float32), None, (4, 64))
    assert int16 is None  # 16-bit codes: the kernels' own int64 sums, not modelled here


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(32, name="b")(nn.gelu(nn.Dense(384, name="a")(x)))


@pytest.mark.parametrize("schema", ["dynamic", "static"])
def test_simulate_equals_the_xla_integer_matmuls_bit_for_bit(schema):
    x = RNG.standard_normal((16, 640)).astype(np.float32)
    model = Mlp()
    variables = model.init(jax.random.key(0), x[:1])
    rules = [odmlq.Rule(".*", op="dot_general", weight_qtype="int8", act_qtype="int8",
                        act_dynamic=schema == "dynamic")]
    plan = odmlq.plan(model, rules, x[:1], variables=variables, target="xla")
    calibration = odmlq.calibrate(model, plan, [x], variables=variables)
    simulated = np.asarray(odmlq.simulate(model, plan, calibration, x, variables=variables))
    qmodel = odmlq.ptq(model, plan, variables, calibration)
    assert all(r.emulated is None for r in qmodel.lowerings.values())
    # Both jitted: XLA compiles a run-time scale's division by a constant
    # (max - min) / 255 as a multiply, 1 ulp from the eager division.
    np.testing.assert_array_equal(np.asarray(jax.jit(qmodel.apply)(qmodel.params, x)), simulated)
