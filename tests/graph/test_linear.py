"""weight_inputs: a matmul or convolution's weight as a matrix, and the input
rows it multiplies, read from the op as traced (exact: the same float32
products summed in another order, so within float32 rounding)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from odmlq.graph import WeightLayout, weight_inputs


def _check(compute, operands, weight_index, out_features):
    layout, patches = weight_inputs(compute, operands, weight_index)
    w = np.asarray(operands[weight_index])
    matrix = layout.matrix(w)
    rebuilt = np.einsum("rgi,goi->rgo", np.asarray(patches), matrix).reshape(-1, out_features)
    expected = np.asarray(compute(*operands))
    expected = np.moveaxis(expected, -1, -1).reshape(-1, out_features)
    # float32 sums of up to 72 products in another order: rtol 1e-5
    np.testing.assert_allclose(rebuilt, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(layout.from_matrix(matrix, w.shape), w)
    return layout


@pytest.mark.parametrize("groups,cin,cout", [(1, 3, 5), (4, 4, 8), (4, 4, 4)], ids=["dense", "grouped", "depthwise"])
def test_convolution_patches_times_the_kernel_matrix_are_the_convolution(groups, cin, cout):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 9, 7, cin)).astype(np.float32)
    w = rng.standard_normal((3, 2, cin // groups, cout)).astype(np.float32)

    def conv(x, w):  # stride, uneven padding and dilation: the op's own geometry
        return lax.conv_general_dilated(x, w, (2, 1), ((1, 1), (0, 1)), rhs_dilation=(1, 2),
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=groups)

    layout = _check(conv, [x, w], 1, cout)
    assert layout == WeightLayout(out_axes=(3,), in_axes=(2, 0, 1), groups=groups)


@pytest.mark.parametrize("weight_first", [False, True], ids=["x@w", "w@x"])
def test_dense_general_rows_times_the_kernel_matrix_are_the_matmul(weight_first):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 6)).astype(np.float32)
    w = rng.standard_normal((6, 3, 4)).astype(np.float32)
    if weight_first:
        layout = _check(lambda w, x: jnp.einsum("dhk,bsd->bshk", w, x).reshape(2, 5, 12), [w, x], 0, 12)
    else:
        layout = _check(lambda x, w: jnp.einsum("bsd,dhk->bshk", x, w).reshape(2, 5, 12), [x, w], 1, 12)
    assert layout == WeightLayout(out_axes=(1, 2), in_axes=(0,))


def test_it_traces_under_jit():
    x, w = jnp.ones((3, 4)), jnp.ones((4, 2))
    patches = jax.jit(lambda x, w: weight_inputs(lambda a, b: a @ b, [x, w], 1)[1])(x, w)
    assert patches.shape == (3, 1, 4)


@pytest.mark.parametrize("compute,shape", [
    (lambda x, w: x @ w + x @ (2 * w), (4, 2)),
    (lambda x, w: x @ w.reshape(4, 2), (8,)),
    (lambda x, w: x * w, (3, 4)),
], ids=["two-readers", "reshaped", "elementwise"])
def test_what_it_cannot_read_is_named(compute, shape):
    found = weight_inputs(compute, [jnp.ones((3, 4)), jnp.ones(shape)], 1)
    assert found == "its weight is read by other than one matmul or convolution, as it is"
