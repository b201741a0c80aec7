"""The converter runs in a child process: its failures and crashes become errors."""

import jax
import numpy as np
import pytest

from odmlq.litert._convert import ConversionError, convert


def test_converts_in_a_child_process():
    tflite = convert(lambda x: x * 2.0, (np.ones((1, 4), np.float32),), input_names=["x"], output_names=["y"])
    assert tflite[4:8] == b"TFL3"


def test_converter_crash_is_an_error_not_the_end_of_the_program():
    """litert-converter 0.5.0 segfaults on a tfl.gelu composite without `approximate`."""

    def gelu(x):
        return jax.lax.composite(lambda v: jax.nn.gelu(v, approximate=False), name="tfl.gelu")(x)

    with pytest.raises(ConversionError, match=r"litert-converter crashed \(SIGSEGV\) while converting"):
        convert(gelu, (np.ones((1, 8), np.float32),), input_names=["x"], output_names=["y"])


def test_unconverted_op_is_named_with_its_location():
    def spectrum(x):
        with jax.named_scope("block/fft"):
            return jax.numpy.abs(jax.numpy.fft.fft(x))

    with pytest.raises(ConversionError, match=r"fft_v1 was not converted to a LiteRT op") as info:
        convert(spectrum, (np.ones((1, 8), np.float32),), input_names=["x"], output_names=["y"])
    assert any(loc.startswith("block/fft") for loc in info.value.locations)
