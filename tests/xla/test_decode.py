"""The fast decoders give exactly qarray's values (every representable input)."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from odmlq.qarray import pack, unpack
from odmlq.qtypes import NF4_LEVELS
from odmlq.xla import _decode


@pytest.mark.parametrize("dtype", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2])
def test_fp8_bits_decode_to_the_cast_of_every_finite_value(dtype):
    values = np.arange(256, dtype=np.uint8).view(dtype)
    finite = values[np.isfinite(values.astype(np.float32))]
    got = np.asarray(_decode.fp8_to_float32(jnp.asarray(finite)))
    expected = finite.astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))  # signed zeros too


def test_nf4_select_tree_gives_the_levels():
    np.testing.assert_array_equal(_decode.nf4_to_float32(jnp.arange(16, dtype=jnp.uint8)), NF4_LEVELS)


@pytest.mark.parametrize("qtype", ["int4", "nf4"])
def test_nibbles_are_the_even_and_odd_columns(qtype):
    rng = np.random.default_rng(0)
    values = rng.integers(-8, 8, (6, 10)) if qtype == "int4" else rng.integers(0, 16, (6, 10))
    packed = pack(values.astype(np.int8 if qtype == "int4" else np.uint8), qtype).reshape(6, 5)
    even, odd = _decode.nibbles(packed, signed=qtype == "int4")
    np.testing.assert_array_equal(even, values[:, 0::2])
    np.testing.assert_array_equal(odd, values[:, 1::2])
    np.testing.assert_array_equal(_decode.interleave(even, odd), unpack(packed.reshape(-1), qtype, (6, 10)))
