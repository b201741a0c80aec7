"""1-D convolutions (audio front ends: transformers' Wav2Vec2 feature
extractor, grouped positional convolutions) in every LiteRT schema.

LiteRT has no 1-D convolution kernel; the export computes each as the 2-D one
over a spatial axis of size 1 (`odmlq.litert._conv1d.one_dimensional_as_two`)
and stores its filter as that kernel's. Before, litert-converter 0.5.0 failed
on the dynamic-range export ('Invalid ranks', naming no op), and the
weight-only export transposed each dequantized filter at every invocation
(refused by the export's own check).
"""

import flax.linen as nn
import jax
import numpy as np
import pytest

import odmlq
from odmlq.litert.inspect import inspect
from tests._runs import simulate_sqnr_db
from tests.litert.test_external import _external_buffers

R = odmlq.Rule
SCHEMAS = {
    "int8": [R(".*", weight_qtype="int8", act_qtype="int8")],
    "int16x8": [R(".*", weight_qtype="int8", act_qtype="int16")],
    "dynamic": [R(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)],
    "weight_only": [R(".*", weight_qtype="int8")],
}


class Audio(nn.Module):
    """Strided, pointwise, grouped and depthwise 1-D convolutions over (batch, time, channels)."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu6(nn.Conv(16, (5,), strides=(2,), padding="VALID", name="strided")(x))
        x = nn.relu(nn.Conv(16, (1,), name="pointwise")(x))
        x = x + nn.Conv(16, (4,), padding="SAME", feature_group_count=4, name="grouped")(x)
        x = nn.Conv(16, (3,), feature_group_count=16, name="depthwise")(x)
        return nn.Dense(4, name="head")(x.mean(axis=1))


@pytest.fixture(scope="module")
def audio():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 40, 3)).astype(np.float32)
    model = Audio()
    return model, model.init(jax.random.key(0), x[:1]), x


@pytest.mark.parametrize("schema", list(SCHEMAS))
def test_a_one_dimensional_convolution_is_a_two_dimensional_kernel_in_every_schema(audio, schema):
    model, variables, x = audio
    result = odmlq.export_tflite(model, SCHEMAS[schema], [x[:8]], variables=variables, benchmark=False)
    # Verified op by op against simulate on held-out and perturbed inputs (the
    # export raises otherwise): within 1 LSB per edge for the static schemas,
    # 1e-4 of each op's largest value for the float ones.
    assert result.verification.passed, str(result.verification)
    summary = inspect(result.tflite)
    convolutions = [op for op in summary.ops if op.name in ("CONV_2D", "DEPTHWISE_CONV_2D")]
    assert len(convolutions) == 4, summary.op_histogram
    for op in convolutions:
        fltr = summary.tensors[op.inputs[1]]
        assert len(fltr.shape) == 4 and 1 in fltr.shape[1:3], fltr.shape
        # Weight-only filters are dequantized for the float kernel; the dynamic-range
        # schema keeps depthwise filters float (LiteRT's hybrid depthwise kernel runs
        # outside XNNPACK: the plan's choice).
        if schema != "weight_only" and not (schema == "dynamic" and op.name == "DEPTHWISE_CONV_2D"):
            assert fltr.dtype == "int8" and fltr.is_constant, (schema, fltr)
    # No filter is transposed (or, but for weight-only, dequantized) at every invocation.
    assert not [op for op in summary.weight_work_at_run_time
                if op.name == "TRANSPOSE" or schema != "weight_only"], summary.op_histogram
    if schema in ("int8", "weight_only"):
        assert result.delegation.partitions == 1 and not result.delegation.outside, result.delegation
    sqnr = simulate_sqnr_db(model, result, x[8:], variables)
    # int8 weights (and int8 activations) on four layers: the file (equal to simulate,
    # above) stays within the usual 25 dB of float at least.
    assert sqnr > 25, (schema, sqnr)


def test_the_xla_backend_runs_the_same_one_dimensional_convolutions_as_simulate(audio):
    model, variables, x = audio
    rules = SCHEMAS["int8"]
    plan = odmlq.plan(model, rules, x[:1], variables=variables, target="xla")
    calibration = odmlq.calibrate(model, plan, [x[:8]], variables=variables)
    qmodel = odmlq.ptq(model, plan, variables, calibration)
    assert qmodel.lowerings["strided/conv"].kernel.startswith("int8 x int8"), qmodel.lowerings["strided/conv"]
    simulated = np.asarray(odmlq.simulate(model, plan, calibration, x[8:], variables=variables))
    xla = np.asarray(qmodel.apply(qmodel.params, x[8:]))
    # The same integers on every static edge; the float head sums in another order.
    assert np.max(np.abs(xla - simulated)) <= 1e-5 * np.max(np.abs(simulated)) + 1e-6


# The dynamic-range schema keeps the depthwise filter float, inline.
@pytest.mark.parametrize("schema, quantized", [("int8", 5), ("dynamic", 4)])
def test_one_dimensional_filters_written_after_conversion_hold_the_same_integers(audio, schema, quantized):
    """External weights: the converter sees zeros of the 2-D filter's shape and the
    export writes the integers into it afterwards, in that shape."""
    model, variables, x = audio
    common = dict(variables=variables, benchmark=False, progress=False)
    inline = odmlq.export_tflite(model, SCHEMAS[schema], [x[:8]], **common)
    external = odmlq.export_tflite(model, SCHEMAS[schema], [x[:8]], external_weights=True, **common)
    assert external.verification.passed, str(external.verification)
    # The quantized filters and the head's kernel lie after the flatbuffer.
    assert len(_external_buffers(external.tflite)) == quantized
    inline_interpreter = odmlq.litert.interpreter(inline.tflite)
    external_interpreter = odmlq.litert.interpreter(external.tflite)
    inline_interpreter.set_tensor(inline_interpreter.get_input_details()[0]["index"], x[8:9])
    external_interpreter.set_tensor(external_interpreter.get_input_details()[0]["index"], x[8:9])
    inline_interpreter.invoke()
    external_interpreter.invoke()
    out = [i.get_tensor(i.get_output_details()[0]["index"]) for i in (inline_interpreter, external_interpreter)]
    np.testing.assert_array_equal(out[0], out[1])


class Pooled(nn.Module):
    """1-D max and average pools over (batch, time, channels), as a keyword
    spotter or a time-series CNN writes them."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3,), name="first")(x))
        x = nn.max_pool(x, (3,), strides=(1,), padding="SAME")  # (int16: padded with zeros after the ReLU)
        x = nn.max_pool(x, (2,), strides=(2,))
        x = nn.Conv(16, (3,), name="second")(x)
        x = nn.avg_pool(x, (2,), strides=(2,))
        x = nn.avg_pool(x, (3,), strides=(1,), padding="SAME")  # counts its padding (Flax's default)
        x = nn.avg_pool(x, (3,), strides=(1,), padding="SAME", count_include_pad=False)
        return nn.Dense(4, name="head")(x.reshape(x.shape[0], -1))


@pytest.mark.parametrize("schema", ["int8", "int16x8", "dynamic", "float"])
def test_a_one_dimensional_pool_is_a_two_dimensional_kernel_in_every_schema(schema):
    """Before: every 1-D pool stayed a STABLEHLO_REDUCE_WINDOW, float and off
    XNNPACK; a full-integer export refused the float islands (and a 1-D max pool
    before a concatenation failed to convert)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(12, 32, 3)).astype(np.float32)
    model = Pooled()
    variables = model.init(jax.random.key(0), x[:1])
    result = odmlq.export_tflite(model, SCHEMAS.get(schema, []), [x[:8]], variables=variables, benchmark=False)
    assert schema == "float" or result.verification.passed, str(result.verification)
    histogram = dict(inspect(result.tflite).op_histogram)
    assert not [name for name in histogram if name.startswith("STABLEHLO")], histogram
    assert histogram.get("MAX_POOL_2D") == 2, histogram
    # An int8 average pool is a depthwise convolution (XNNPACK has no int8 AVERAGE_POOL_2D),
    # but for the one that does not count its padding.
    assert histogram.get("AVERAGE_POOL_2D") == (1 if schema == "int8" else 3), histogram
    # XNNPACK takes no int16 op, and no int8 AVERAGE_POOL_2D (as for 2-D pools).
    outside = [op.name for op in result.delegation.outside]
    assert outside == {"int8": ["AVERAGE_POOL_2D"], "int16x8": outside}.get(schema, []), result.delegation
    if schema == "float":  # the file computes the model: float32 rounding only
        interpreter = odmlq.litert.interpreter(result.tflite)
        interpreter.set_tensor(interpreter.get_input_details()[0]["index"], x[8:9])
        interpreter.invoke()
        got = interpreter.get_tensor(interpreter.get_output_details()[0]["index"])
        want = np.asarray(model.apply(variables, x[8:9]))
        assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want)), (got, want)
    else:  # (the file equals simulate, above) within the usual 25 dB of float
        assert simulate_sqnr_db(model, result, x[8:], variables) > 25, schema
