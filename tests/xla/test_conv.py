"""The quantized convolutions against plain references (integer sums compared exactly)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from odmlq.qarray import quantize_tensor
from odmlq.xla import _conv

RNG = np.random.default_rng(0)


def _codes(shape, low=-128, high=127):
    values = RNG.integers(low, high + 1, shape).astype(np.int8)
    values.flat[:4] = [low, high, low, high]
    return values


@pytest.mark.parametrize("padding", ["SAME", "VALID"])
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("zero_point", [None, 9])
def test_integer_conv_pads_with_the_zero_point(padding, groups, zero_point):
    xq = jnp.asarray(_codes((2, 6, 6, 8)))
    w = RNG.standard_normal((3, 3, 8 // groups, 4)).astype(np.float32)
    q = quantize_tensor(w, "int8", scale_axes=(3,), narrow_range=True)
    dn = lax.conv_dimension_numbers(xq.shape, q.shape, ("NHWC", "HWIO", "NHWC"))
    # What the model computes: the convolution of (xq - zp), padded with 0.0; in
    # float32 on integers it is exact (sums stay far below 2**24).
    x_float = xq.astype(jnp.float32) - (zero_point or 0)

    def conv(a, b):
        return lax.conv_general_dilated(a, b, (1, 1), padding, dimension_numbers=dn, feature_group_count=groups)

    exact = conv(x_float, q.values().astype(jnp.float32))
    params = jax.make_jaxpr(conv)(x_float, w).eqns[0].params
    zp = None if zero_point is None else jnp.full((1, 1, 1, 1), zero_point, jnp.int32)
    got = _conv.conv_int(xq, zp, q, params) / q.scale.reshape(1, 1, 1, -1)
    np.testing.assert_array_equal(np.round(np.asarray(got)), np.asarray(exact))


@pytest.mark.parametrize("qtype,kwargs", [
    ("int8", dict(scale_axes=(3,), narrow_range=True)),
    ("int8", dict(symmetric=False)),
    ("int4", dict(scale_axes=(3,), block_axis=2, block_size=4, narrow_range=True)),
    ("fp8_e5m2", dict(scale_axes=(3,))),
    ("nf4", dict(scale_axes=(3,), block_axis=2, block_size=2)),
], ids=["int8", "int8-asym", "int4-block4", "fp8-e5m2", "nf4-block2"])
def test_the_decoded_kernel_is_exactly_dequantize(qtype, kwargs):
    w = RNG.standard_normal((3, 3, 8, 5)).astype(np.float32)  # 360 values: an even count of nibbles
    q = quantize_tensor(w, qtype, **kwargs)
    np.testing.assert_array_equal(_conv.dequantized_kernel(q), q.dequantize())
