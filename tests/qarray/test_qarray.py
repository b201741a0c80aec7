"""Tests of odmlq.qarray: quantize/dequantize numerics, packing, pytree use, errors."""

import dataclasses
import functools
import math

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from odmlq.errors import CalibrationError, GranularityError, QTypeError
from odmlq.qarray import (
    QArray, compute_scale, fake_quant, pack, quantize, quantize_tensor, reduce_range, scale_shape, unpack,
)
from odmlq.qtypes import NF4_LEVELS, qtype

INT_QTYPES = ["int2", "int3", "int4", "int5", "int6", "int7", "int8", "int16"]
FP8_QTYPES = ["fp8_e4m3", "fp8_e5m2"]
SHAPE = (4, 8)  # fixed, so jax compiles each op once, not once per example
GRANULARITIES = {
    "per_tensor": {},
    "per_channel": {"scale_axes": (1,)},
    "per_block": {"scale_axes": (0,), "block_axis": 1, "block_size": 4},
}
SYMMETRY = {"symmetric": True, "asymmetric": False}

# Deterministic examples and no example database: the default run stays fast and repeatable.
settings = functools.partial(
    hypothesis.settings, max_examples=12, deadline=None, derandomize=True, database=None
)


def floats(bound=1e3):
    return st.floats(-bound, bound, width=32, allow_nan=False, allow_subnormal=False)


def arrays(shape=SHAPE, bound=1e3):
    return hnp.arrays(np.float32, shape, elements=floats(bound))


def expand(param, q: QArray) -> np.ndarray:
    """A scale or zero point repeated to the logical shape of `q`."""
    param = np.asarray(param)
    if q.block_axis is not None:
        param = np.repeat(param, q.block_size, axis=q.block_axis)
    return np.broadcast_to(param, q.shape)


# --- numerics of integer quantization -------------------------------------------


@pytest.mark.parametrize("symmetric", SYMMETRY.values(), ids=SYMMETRY.keys())
@pytest.mark.parametrize("granularity", GRANULARITIES.values(), ids=GRANULARITIES.keys())
@pytest.mark.parametrize("name", INT_QTYPES)
@settings()
@hypothesis.given(x=arrays())
def test_round_trip_error_is_at_most_half_a_scale(name, granularity, symmetric, x):
    q = quantize_tensor(x, name, symmetric=symmetric, **granularity)
    error = np.abs(np.asarray(q.dequantize()) - x)
    # Half a step of rounding, plus float32 rounding of x / scale and (q - z) * scale.
    bound = expand(q.scale, q) / 2 + 1e-6 * np.abs(x).max()
    np.testing.assert_array_less(error, bound + np.finfo(np.float32).tiny)


@pytest.mark.parametrize("narrow_range", [False, True], ids=["full_range", "narrow_range"])
@pytest.mark.parametrize("name", INT_QTYPES)
@settings()
@hypothesis.given(x=arrays(), shrink=st.floats(0.05, 2.0), zero_point=st.integers(-(2**15), 2**15))
def test_codes_stay_in_range_and_narrow_range_never_makes_qmin(name, narrow_range, x, shrink, zero_point):
    qt = qtype(name)
    # A scale too small for x forces clipping; any zero point in range is allowed.
    scale = max(float(np.abs(x).max()), 1.0) / qt.qmax * shrink
    qmin, qmax = qt.range(narrow_range)
    zero_point = int(np.clip(zero_point, qmin, qmax))
    values = np.asarray(
        quantize(x, name, scale=scale, zero_point=zero_point, narrow_range=narrow_range).values()
    ).astype(np.int64)
    assert values.min() >= qmin and values.max() <= qmax, (values.min(), values.max(), qmin, qmax)


@pytest.mark.parametrize("narrow_range", [False, True], ids=["full_range", "narrow_range"])
@pytest.mark.parametrize("name", INT_QTYPES)
@settings()
@hypothesis.given(lo=floats(), hi=floats())
def test_zero_is_exactly_representable_when_asymmetric(name, narrow_range, lo, hi):
    lo, hi = min(lo, hi), max(lo, hi)
    scale, zero_point = compute_scale(
        np.float32(lo), np.float32(hi), name, symmetric=False, narrow_range=narrow_range
    )
    zeros = np.zeros(3, np.float32)
    out = fake_quant(zeros, name, scale=scale, zero_point=zero_point, narrow_range=narrow_range)
    np.testing.assert_array_equal(out, np.zeros(3, np.float32))


@pytest.mark.parametrize("symmetric", SYMMETRY.values(), ids=SYMMETRY.keys())
@pytest.mark.parametrize("granularity", GRANULARITIES.values(), ids=GRANULARITIES.keys())
@pytest.mark.parametrize("name", ["int4", "int8"])
@settings()
@hypothesis.given(x=arrays())
def test_fake_quant_is_idempotent(name, granularity, symmetric, x):
    q = quantize_tensor(x, name, symmetric=symmetric, **granularity)
    params = dict(scale=q.scale, zero_point=q.zero_point, **granularity)
    once = fake_quant(x, name, **params)
    np.testing.assert_array_equal(fake_quant(once, name, **params), once)


@pytest.mark.parametrize("symmetric", SYMMETRY.values(), ids=SYMMETRY.keys())
@pytest.mark.parametrize("axis", [0, 1, 2])
@settings(max_examples=6)
@hypothesis.given(x=arrays(shape=(3, 3, 3)))  # equal sizes: every slice reuses one compilation
def test_per_channel_equals_per_tensor_slice_by_slice(axis, symmetric, x):
    q = quantize_tensor(x, "int8", scale_axes=(axis,), symmetric=symmetric, narrow_range=True)
    scale, zero_point, values, dequantized = (
        None if a is None else np.asarray(a) for a in (q.scale, q.zero_point, q.values(), q.dequantize())
    )
    for i in range(x.shape[axis]):
        piece = quantize(
            np.take(x, i, axis), "int8", scale=np.take(scale, i, axis).item(), narrow_range=True,
            zero_point=None if symmetric else np.take(zero_point, i, axis).item(),
        )
        np.testing.assert_array_equal(piece.values(), np.take(values, i, axis))
        np.testing.assert_array_equal(piece.dequantize(), np.take(dequantized, i, axis))


HALF_WAY = [(0.5, 0), (1.5, 2), (2.5, 2), (3.5, 4), (-0.5, 0), (-1.5, -2), (-2.5, -2)]


@pytest.mark.parametrize("zero_point", [None, 3], ids=["symmetric", "zero_point_3"])
@pytest.mark.parametrize(("steps", "expected"), HALF_WAY, ids=[f"{s}x_scale" for s, _ in HALF_WAY])
def test_rounds_half_to_even(steps, expected, zero_point):
    scale = 0.375  # steps * scale and its quotient by scale are exact in float32
    q = quantize(np.float32(steps * scale), "int8", scale=scale, zero_point=zero_point)
    assert int(q.values()) == expected + (zero_point or 0)


def test_blocks_repeat_each_scale_block_size_times_along_the_block_axis():
    x = np.random.default_rng(1).normal(size=(3, 8)).astype(np.float32)
    q = quantize_tensor(x, "int8", scale_axes=(0,), block_axis=1, block_size=4, symmetric=False)
    assert q.scale.shape == q.zero_point.shape == (3, 2)
    codes = np.asarray(q.values()).astype(np.int32)
    scale, zero_point = np.repeat(q.scale, 4, axis=1), np.repeat(q.zero_point, 4, axis=1)
    # The same float32 operations as dequantize: an exact comparison.
    np.testing.assert_array_equal(q.dequantize(), (codes - zero_point).astype(np.float32) * scale)


def test_reduce_range_per_block_matches_numpy():
    x = np.arange(48, dtype=np.float32).reshape(2, 4, 6) * np.float32(-1.5) + 7
    lo, hi = reduce_range(x, scale_axes=(0,), block_axis=2, block_size=3)
    blocks = x.reshape(2, 4, 2, 3)
    np.testing.assert_array_equal(lo, blocks.min(axis=(1, 3))[:, None, :])
    np.testing.assert_array_equal(hi, blocks.max(axis=(1, 3))[:, None, :])
    assert scale_shape(x.shape, (0,), 2, 3) == lo.shape == (2, 1, 2)


@pytest.mark.parametrize(
    ("name", "symmetric", "narrow_range", "expected_scale", "expected_zero_point"),
    [
        ("int8", True, False, 3.0 / 127, None),
        ("int8", True, True, 3.0 / 127, None),
        ("int8", False, False, 5.0 / 255, round(-128 + 2.0 / (5.0 / 255))),
        ("int8", False, True, 5.0 / 254, round(-127 + 2.0 / (5.0 / 254))),
        ("int4", False, False, 5.0 / 15, round(-8 + 2.0 / (5.0 / 15))),
        ("fp8_e4m3", True, False, 3.0 / 448, None),
        ("fp8_e5m2", True, False, 3.0 / 57344, None),
        ("nf4", True, False, 3.0, None),
    ],
    ids=["int8_sym", "int8_sym_narrow", "int8_asym", "int8_asym_narrow", "int4_asym", "e4m3", "e5m2", "nf4"],
)
def test_compute_scale_formulas(name, symmetric, narrow_range, expected_scale, expected_zero_point):
    scale, zero_point = compute_scale(
        np.float32(-2.0), np.float32(3.0), name, symmetric=symmetric, narrow_range=narrow_range
    )
    np.testing.assert_allclose(scale, expected_scale, rtol=1e-6)  # a float32 formula
    if expected_zero_point is None:
        assert zero_point is None
    else:
        assert zero_point.dtype == jnp.int32 and int(zero_point) == expected_zero_point


@pytest.mark.parametrize("symmetric", SYMMETRY.values(), ids=SYMMETRY.keys())
def test_zero_range_gives_scale_one_and_exact_zeros(symmetric):
    zeros = np.zeros(SHAPE, np.float32)
    q = quantize_tensor(zeros, "int8", scale_axes=(0,), symmetric=symmetric)
    np.testing.assert_array_equal(q.scale, np.ones((4, 1), np.float32))
    expected_code = 0 if symmetric else -128
    np.testing.assert_array_equal(q.values(), np.full(SHAPE, expected_code, np.int8))
    np.testing.assert_array_equal(q.dequantize(), zeros)


# --- fp8 and nf4 --------------------------------------------------------------------

# Round to nearest with m mantissa bits: relative error at most 2^-(m+1) for normal values.
FP8_BOUNDS = {"fp8_e4m3": (2.0**-4, ml_dtypes.float8_e4m3fn), "fp8_e5m2": (2.0**-3, ml_dtypes.float8_e5m2)}


@pytest.mark.parametrize("name", FP8_QTYPES)
@settings(max_examples=20)
@hypothesis.given(magnitudes=arrays(bound=1.0), scale=st.floats(1e-3, 1e3))
def test_fp8_round_trip_relative_error(name, magnitudes, scale):
    bound, dtype = FP8_BOUNDS[name]
    info = ml_dtypes.finfo(dtype)
    # Keep x / scale among the normal numbers of the format, where the bound holds.
    top, smallest = float(info.max), float(info.smallest_normal)
    ratio = np.where(magnitudes < 0, -1, 1) * np.clip(np.abs(magnitudes) * top, smallest, top)
    x = (ratio * np.float32(scale)).astype(np.float32)
    out = np.asarray(fake_quant(x, name, scale=np.float32(scale)))
    np.testing.assert_array_less(np.abs(out - x), np.abs(x) * (bound + 1e-6))


@pytest.mark.parametrize("name", FP8_QTYPES)
def test_fp8_saturates_at_max(name):
    _, dtype = FP8_BOUNDS[name]
    top = float(ml_dtypes.finfo(dtype).max)
    x = np.array([1e30, -1e30, np.inf, -np.inf, 2 * top, top], np.float32)
    out = fake_quant(x, name, scale=2.0)
    np.testing.assert_array_equal(out, np.array([1, -1, 1, -1, 1, 0.5]) * 2 * top)
    assert quantize(x, name, scale=2.0).values().dtype == dtype


@settings(max_examples=20)
@hypothesis.given(
    x=arrays(), channel_scale=hnp.arrays(np.float32, (4, 1), elements=st.floats(1 / 64, 64, width=32))
)
def test_nf4_picks_nearest_level_and_dequantizes_to_level_times_scale(x, channel_scale):
    q = quantize(x, "nf4", scale=channel_scale, scale_axes=(0,))
    indices = np.asarray(q.values()).astype(np.int64)
    ratio = x / channel_scale
    # argmin takes the first (lower) index on a tie, as quantize does.
    nearest = np.argmin(np.abs(np.clip(ratio, -1, 1)[..., None] - NF4_LEVELS), axis=-1)
    np.testing.assert_array_equal(indices, nearest)
    np.testing.assert_array_equal(q.dequantize(), NF4_LEVELS[indices] * channel_scale)


def test_nf4_midpoints_go_to_the_lower_level():
    midpoints = (NF4_LEVELS[:-1] + NF4_LEVELS[1:]) / np.float32(2)
    np.testing.assert_array_equal(quantize(midpoints, "nf4", scale=1.0).values(), np.arange(15))


# --- packing and storage -------------------------------------------------------------

PACKED = {"int2": (-2, 2), "int4": (-8, 8), "nf4": (0, 16)}


@pytest.mark.parametrize("name", PACKED)
@settings()
# Sizes with every remainder modulo 2 and 4; each new size is a new compilation.
@hypothesis.given(data=st.data(), size=st.sampled_from([1, 2, 3, 5, 6, 7, 13]))
def test_pack_unpack_round_trip(name, data, size):
    low, high = PACKED[name]
    values = np.asarray(data.draw(st.lists(st.integers(low, high - 1), min_size=size, max_size=size)))
    values = values.astype(qtype(name).storage_dtype)
    packed = pack(values, name)
    assert packed.dtype == jnp.uint8 and packed.shape == (math.ceil(size / qtype(name).values_per_byte),)
    np.testing.assert_array_equal(unpack(packed, name, (size,)), values)


@pytest.mark.parametrize(
    ("name", "values", "expected_bytes"),
    [
        ("int4", [1, -1, 3], [0xF1, 0x03]),
        ("int2", [1, -1, 0, -2, 1], [0b10_00_11_01, 0x01]),
        ("nf4", [15, 0, 7], [0x0F, 0x07]),
    ],
    ids=["int4", "int2", "nf4"],
)
def test_pack_puts_the_first_value_in_the_low_bits(name, values, expected_bytes):
    packed = pack(np.array(values, qtype(name).storage_dtype), name)
    np.testing.assert_array_equal(packed, np.array(expected_bytes, np.uint8))


BYTES_PER_VALUE = {"int8": 1, "int4": 1 / 2, "nf4": 1 / 2, "int2": 1 / 4, "int16": 2}


@pytest.mark.parametrize("size", [7, 1000])
@pytest.mark.parametrize(("name", "bytes_per_value"), BYTES_PER_VALUE.items(), ids=BYTES_PER_VALUE.keys())
def test_nbytes_counts_what_is_stored(name, bytes_per_value, size):
    x = np.linspace(-1, 1, size, dtype=np.float32)
    value_bytes = math.ceil(size * bytes_per_value)  # packed values round up to a whole byte
    assert quantize_tensor(x, name).nbytes == value_bytes + 4  # plus one float32 scale
    if qtype(name).is_integer:
        # plus one int32 zero point
        assert quantize_tensor(x, name, symmetric=False).nbytes == value_bytes + 8


STORAGE = {"int3": np.int8, "int16": np.int16, "int4": np.int8, "nf4": np.uint8, "fp8_e5m2": ml_dtypes.float8_e5m2}


@pytest.mark.parametrize(("name", "dtype"), STORAGE.items(), ids=STORAGE.keys())
def test_values_are_in_the_logical_shape_and_storage_dtype(name, dtype):
    q = quantize_tensor(np.ones((3, 5), np.float32), name)
    assert q.values().shape == (3, 5) and q.values().dtype == dtype and q.ndim == 2


# --- pytree, jit, input types ----------------------------------------------------------


@pytest.mark.parametrize("symmetric", SYMMETRY.values(), ids=SYMMETRY.keys())
def test_qarray_passes_through_jit_and_tree_map(symmetric):
    x = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
    q = quantize_tensor(x, "int4", scale_axes=(0,), block_axis=1, block_size=3, symmetric=symmetric)

    @jax.jit
    def double_scale(q: QArray) -> QArray:
        return dataclasses.replace(q, scale=q.scale * 2)

    doubled = double_scale(q)
    assert isinstance(doubled, QArray) and repr(doubled) == repr(q)
    np.testing.assert_array_equal(doubled.dequantize(), 2 * np.asarray(q.dequantize()))
    assert len(jax.tree.leaves(q)) == (2 if symmetric else 3)
    as_numpy = jax.tree.map(np.asarray, q)
    assert isinstance(as_numpy.qvalue, np.ndarray)
    np.testing.assert_array_equal(as_numpy.dequantize(), q.dequantize())
    jitted = jax.jit(functools.partial(quantize_tensor, qtype="int4", scale_axes=(0,), block_axis=1,
                                       block_size=3, symmetric=symmetric))(x)
    for got, want in zip(jax.tree.leaves(jitted), jax.tree.leaves(q)):
        np.testing.assert_array_equal(got, want)  # integer values of two of our own paths: exact


def test_fake_quant_jits_and_keeps_the_input_float_dtype():
    x = np.linspace(-3, 3, 32, dtype=np.float32).reshape(4, 8)
    scale = np.full((4, 1), 0.05, np.float32)
    eager = fake_quant(x, "int8", scale=scale, scale_axes=(0,))
    jitted_fake_quant = jax.jit(fake_quant, static_argnames=("qtype", "scale_axes"))
    jitted = jitted_fake_quant(x, "int8", scale=scale, scale_axes=(0,))
    np.testing.assert_array_equal(jitted, eager)
    np.testing.assert_array_equal(fake_quant(jnp.asarray(x), "int8", scale=scale, scale_axes=(0,)), eager)
    assert fake_quant(jnp.asarray(x, jnp.bfloat16), "int8", scale=scale, scale_axes=(0,)).dtype == jnp.bfloat16
    assert fake_quant(x.astype(np.float64), "int8", scale=scale, scale_axes=(0,)).dtype == jnp.float32


# --- errors --------------------------------------------------------------------------


def test_block_size_that_does_not_divide_names_axis_size_and_divisors():
    message = r"block_size 30 does not divide axis 1 of size 64 .*such as 16 or 32"
    with pytest.raises(GranularityError, match=message):
        quantize_tensor(np.ones((2, 64)), "int4", block_axis=1, block_size=30)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "nf4"])
def test_asymmetric_float_and_lut_types_are_rejected(name):
    with pytest.raises(QTypeError, match=rf"{name} has no zero point.*symmetric=True"):
        quantize_tensor(np.ones(4), name, symmetric=False)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scale": np.ones(4)}, r"scale has shape \(4,\).*need shape \(1, 1\)"),
        ({"scale": np.ones((2, 1)), "scale_axes": (1,)}, r"scale has shape \(2, 1\).*need shape \(1, 4\)"),
        ({"scale": 1.0, "zero_point": np.zeros(3)}, r"zero_point has shape \(3,\)"),
        ({"scale": 1.0, "scale_axes": (2,)}, r"scale_axes entry=2 is not an axis .* use an int in \[-2, 2\)"),
        ({"scale": 1.0, "block_axis": 1}, r"block_axis=1 and block_size=None go together"),
        ({"scale": np.ones((2, 2)), "scale_axes": (1,), "block_axis": 1, "block_size": 2}, r"also in scale_axes"),
    ],
    ids=["per_tensor_scale_too_big", "per_channel_wrong_axis", "zero_point_shape", "axis_out_of_range",
         "block_axis_without_size", "block_axis_in_scale_axes"],
)
def test_bad_granularity_is_rejected(kwargs, match):
    with pytest.raises(GranularityError, match=match):
        quantize(np.ones((2, 4)), "int8", **kwargs)


@pytest.mark.parametrize(
    ("lo", "hi"), [(np.nan, 1.0), (-np.inf, 1.0), (0.0, np.inf)], ids=["nan", "minus_inf", "inf"]
)
def test_non_finite_range_is_a_calibration_error(lo, hi):
    with pytest.raises(CalibrationError, match="not finite"):
        compute_scale(np.array([lo, 0.0]), np.array([hi, 1.0]), "int8", symmetric=True)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: compute_scale(np.ones(2), np.zeros(2), "int8", symmetric=True), CalibrationError, "lo > hi"),
        (lambda: quantize(np.ones(2), "int8", scale=0.0), CalibrationError, r"finite and positive, got \[0.0\]"),
        (lambda: quantize(np.ones(2), "fp8_e4m3", scale=1.0, narrow_range=True), QTypeError, "narrow_range is"),
        (lambda: quantize(np.ones(2), "nf4", scale=1.0, zero_point=0), QTypeError, "nf4 has no zero point"),
        (lambda: unpack(np.zeros(3, np.uint8), "int4", (8,)), QTypeError, "need 4 packed uint8 bytes, got 3"),
        (lambda: quantize_tensor(np.zeros((0, 3)), "int8"), CalibrationError, r"empty tensor \(shape \(0, 3\)\)"),
        (lambda: dataclasses.replace(quantize_tensor(np.ones(2), "int8"), qtype="s8"), QTypeError, "use 'int8'"),
    ],
    ids=["lo_above_hi", "zero_scale", "narrow_fp8", "nf4_zero_point", "unpack_wrong_size", "empty_tensor",
         "alias_in_qarray"],
)
def test_invalid_values_are_rejected(call, error, match):
    with pytest.raises(error, match=match):
        call()
