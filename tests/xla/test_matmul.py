"""The quantized matmuls against plain references.

Tolerances: integer accumulators are compared exactly (int32 on both sides);
float kernels against ``x @ dequantize(w)`` at rtol 1e-5 (float32, summed in
another order: blocks of rows, then across blocks).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from odmlq.qarray import quantize, quantize_tensor
from odmlq.xla import _matmul

RNG = np.random.default_rng(0)


def _layout(x, q, dn=(((1,), (0,)), ((), ())), side=1):
    return _matmul.DotLayout.of(dn, side, x.shape, q.shape)


@pytest.mark.parametrize("qtype,kwargs", [
    ("int8", dict(scale_axes=(1,), narrow_range=True)),
    ("int4", dict(scale_axes=(1,), narrow_range=True)),
    ("int4", dict(scale_axes=(1,), block_axis=0, block_size=16, narrow_range=True)),
    ("int8", dict(symmetric=False)),
    ("fp8_e4m3", dict(scale_axes=(1,))),
    ("nf4", dict(scale_axes=(1,), block_axis=0, block_size=32)),
], ids=["int8", "int4", "int4-block16", "int8-asym", "fp8", "nf4-block32"])
@pytest.mark.parametrize("block_elements", [2**20, 64], ids=["one-block", "blocks"])
def test_weight_only_dot_equals_x_times_dequantized_weight(qtype, kwargs, block_elements):
    w = RNG.standard_normal((64, 8)).astype(np.float32)
    q = quantize_tensor(w, qtype, **kwargs)
    x = jnp.asarray(RNG.standard_normal((3, 64)), jnp.float32)
    matrix = _matmul.matrix_weight(q, _layout(x, q), block_elements)
    # 8 rows per block (64 elements / 8 columns), or one scale block.
    assert matrix.blocks == (1 if block_elements > 64 else 64 // max(8, kwargs.get("block_size", 1)))
    assert matrix.packed == (qtype in ("int4", "nf4"))  # unpacked block by block
    np.testing.assert_allclose(_matmul.dot_float(x, matrix), x @ q.dequantize(), rtol=1e-5, atol=1e-5)


def _codes(shape, low=-128, high=127):
    values = RNG.integers(low, high + 1, shape).astype(np.int8)
    values.flat[:4] = [low, high, low, high]  # the extremes, where an overflow would show
    return values


@pytest.mark.parametrize("zero_point", [None, "tensor", "row"])
@pytest.mark.parametrize("block_elements", [2**20, 256], ids=["one-block", "blocks"])
def test_integer_dot_accumulates_exactly_in_int32(zero_point, block_elements):
    m, k, n = 5, 512, 16
    xq = jnp.asarray(_codes((m, k)))
    wq = _codes((k, n), -127, 127)
    scale = RNG.uniform(0.5, 2.0, (1, n)).astype(np.float32)
    q = quantize(wq.astype(np.float32) * scale, "int8", scale=scale, scale_axes=(1,), narrow_range=True)
    np.testing.assert_array_equal(q.values(), wq)
    zp = {None: None, "tensor": jnp.full((1, 1), 17, jnp.int32),
          "row": jnp.asarray(RNG.integers(-128, 128, (m, 1)), jnp.int32)}[zero_point]
    matrix = _matmul.matrix_weight(q, _layout(xq, q), block_elements)
    got = _matmul.dot_int(xq, zp, matrix)
    shifted = xq.astype(jnp.int32) - (0 if zp is None else zp)
    exact = lax.dot_general(shifted, jnp.asarray(wq, jnp.int32), (((1,), (0,)), ((), ())))
    # The int32 result times the weight scale, once: compare the integers.
    np.testing.assert_array_equal(np.round(np.asarray(got) / scale).astype(np.int64), np.asarray(exact))


def test_integer_dot_with_block_scales_rescales_each_block():
    m, k, n, block = 3, 128, 8, 32
    xq = jnp.asarray(_codes((m, k)))
    w = RNG.standard_normal((k, n)).astype(np.float32)
    q = quantize_tensor(w, "int8", scale_axes=(1,), block_axis=0, block_size=block, narrow_range=True)
    zp = jnp.full((1, 1), -3, jnp.int32)
    matrix = _matmul.matrix_weight(q, _layout(xq, q), 512)
    assert matrix.rows_per_scale == block and matrix.blocks == 2  # two scale blocks per row block
    expected = (xq.astype(jnp.float32) - zp) @ q.dequantize()
    np.testing.assert_allclose(_matmul.dot_int(xq, zp, matrix), expected, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("case", ["rhs-transposed", "lhs", "two-free-axes"])
def test_dot_layouts_other_than_x_at_w(case):
    x = jnp.asarray(RNG.standard_normal((2, 3, 16)), jnp.float32)
    if case == "rhs-transposed":  # weight (N, K): transposed at run time
        w, dn, side = RNG.standard_normal((8, 16)), (((2,), (1,)), ((), ())), 1
    elif case == "lhs":  # weight first: output (N, batch...)
        w, dn, side = RNG.standard_normal((16, 8)), (((0,), (2,)), ((), ())), 0
    else:  # DenseGeneral-like (K, H, D)
        w, dn, side = RNG.standard_normal((16, 2, 4)), (((2,), (0,)), ((), ())), 1
    q = quantize_tensor(np.asarray(w, np.float32), "int8", scale_axes=(0 if case == "rhs-transposed" else w.ndim - 1,),
                        narrow_range=True)
    layout = _matmul.DotLayout.of(dn, side, x.shape, q.shape)
    operands = (q.dequantize(), x) if side == 0 else (x, q.dequantize())
    expected = lax.dot_general(*operands, dn)
    got = layout.output(_matmul.dot_float(layout.x_matrix(x), _matmul.matrix_weight(q, layout)))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_block_rows_divide_and_respect_the_scale_blocks():
    assert _matmul.block_rows(4096, 4096, 1, 2**20) == 256
    assert _matmul.block_rows(64, 512, 1, 2**20) == 64  # small: one block
    assert _matmul.block_rows(4096, 4096, 128, 2**20) == 256
    assert _matmul.block_rows(4096, 4096, 512, 2**20) == 512  # never splits a scale block
    assert _matmul.block_rows(96, 2**20, 1, 2**20) == 1


def test_decode_step_blocks_follow_the_weight_size():
    """A matrix-vector product decodes a small weight in L1-sized blocks (2^13 elements),
    a weight of 2^19 elements or more in 2^16-element blocks (fewer scan steps: a 38M
    decoder's step 0.82x -> 0.97-1.05x float on an AMD EPYC, bench/README.md); integer
    kernels and matmuls of more than 4 rows are unchanged."""
    assert _matmul.default_block_elements(1, True, 256 * 768) == 2**13
    assert _matmul.default_block_elements(1, True, 768 * 768) == 2**16
    assert _matmul.default_block_elements(4, True, 2048 * 768) == 2**16
    assert _matmul.default_block_elements(1, False, 256 * 768) == 2**16
    assert _matmul.default_block_elements(32, True, 2048 * 768) == 2**20
    # Through the matrix a kernel reads: 768 x 2,048 at one row is 32 rows a block (2^16).
    q = quantize_tensor(np.ones((768, 2048), np.float32), "int8", scale_axes=(1,), narrow_range=True)
    x = np.ones((1, 768), np.float32)
    assert _matmul.matrix_weight(q, _layout(x, q)).rows == 32


@pytest.mark.parametrize("block_elements", [2**20, 256], ids=["one-block", "blocks"])
def test_integer_dot_on_packed_int4_weights_is_exact(block_elements):
    """int4 codes stay packed: each block's even and odd columns are two int8 matmuls."""
    m, k, n = 3, 256, 16
    xq = jnp.asarray(_codes((m, k)))
    wq = RNG.integers(-7, 8, (k, n)).astype(np.int8)
    scale = RNG.uniform(0.5, 2.0, (1, n)).astype(np.float32)
    q = quantize(wq.astype(np.float32) * scale, "int4", scale=scale, scale_axes=(1,), narrow_range=True)
    matrix = _matmul.matrix_weight(q, _layout(xq, q), block_elements)
    assert matrix.packed and matrix.groups == 2
    zp = jnp.full((1, 1), -5, jnp.int32)
    got = _matmul.dot_int(xq, zp, matrix)
    exact = lax.dot_general(xq.astype(jnp.int32) - zp, jnp.asarray(wq, jnp.int32), (((1,), (0,)), ((), ())))
    np.testing.assert_array_equal(np.round(np.asarray(got) / scale).astype(np.int64), np.asarray(exact))
