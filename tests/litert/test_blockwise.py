"""int4 weights in blocks on XNNPACK's blockwise kernel (real converter, real
interpreter): what the file stores, where it runs, what it computes."""

import flax.linen as nn
import jax
import ml_dtypes
import numpy as np
import pytest

import odmlq
from odmlq.graph import flat_params
from odmlq.scales import folded_weights
from odmlq.scales._tensor import bfloat16_up, float16_up
from samples.models import cnn
from tests._runs import litert_rows

R = odmlq.Rule
IN, HIDDEN, OUT = 256, 128, 64


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(OUT, name="fc2")(nn.relu(nn.Dense(HIDDEN, name="fc1")(x)))


def _rules(granularity):
    return [R(".*", weight_qtype="int4", act_qtype="int8", act_dynamic=True, weight_granularity=granularity)]


@pytest.fixture(scope="module")
def mlp():
    """Input rows whose magnitude grows 30x across the input axis, as outlier
    features do: one scale per output channel is set by the largest rows."""
    model = MLP()
    rng = np.random.default_rng(0)
    variables = model.init(jax.random.key(0), np.zeros((1, IN), np.float32))
    kernel = np.asarray(variables["params"]["fc1"]["kernel"]) * np.geomspace(0.1, 3.0, IN)[:, None]
    variables = {"params": {**variables["params"], "fc1": {**variables["params"]["fc1"],
                                                            "kernel": kernel.astype(np.float32)}}}
    data = [rng.standard_normal((16, IN)).astype(np.float32) for _ in range(6)]
    return model, variables, data


def _sqnr(reference, value):
    reference, value = np.asarray(reference, np.float64), np.asarray(value, np.float64)
    return 10 * np.log10(np.sum(reference ** 2) / np.sum((value - reference) ** 2))


def _unpacked(tflite: bytes, tensor) -> np.ndarray:
    """The int4 codes of a constant tensor of the file (low nibble first)."""
    from ai_edge_litert import schema_py_generated as schema

    model = schema.ModelT.InitFromPackedBuf(bytearray(tflite), 0)
    raw = np.asarray(model.buffers[model.subgraphs[0].tensors[tensor.index].buffer].data, np.uint8)
    low, high = (raw & 0xF).astype(np.int8), (raw >> 4).astype(np.int8)
    codes = np.stack([low, high], axis=1).reshape(-1)[:int(np.prod(tensor.shape))]
    return np.where(codes > 7, codes - 16, codes).reshape(tensor.shape)


def test_blocks_of_128_run_whole_on_xnnpack_and_hold_the_plan_integers(mlp):
    model, variables, data = mlp
    result = odmlq.export_tflite(model, _rules(odmlq.PerBlock(128)), data, variables=variables,
                                 require_delegate=True)
    assert result.verification.passed and result.delegation.partitions == 1
    values = flat_params(folded_weights(result.plan.graph, variables, result.scales))
    for param, (n_in, n_out) in {"fc1/kernel": (IN, HIDDEN), "fc2/kernel": (HIDDEN, OUT)}.items():
        tensor = next(t for t in result.summary.tensors if t.dtype == "int4" and param in t.name)
        assert tensor.shape == (n_out, n_in) and tensor.block_size == 128, tensor
        assert len(tensor.scales) == n_out * n_in // 128
        # The file's integers times its float16 scales are exactly the plan's
        # weight grid (the values simulate and XLA compute with).
        ts = result.scales.weights[param]
        file_scales = np.asarray(tensor.scales, np.float32).reshape(n_out, n_in // 128)
        np.testing.assert_array_equal(file_scales, np.asarray(ts.scale, np.float32).T)
        file_values = (_unpacked(result.tflite, tensor).reshape(n_out, n_in // 128, 128) * file_scales[..., None])
        plan_values = np.asarray(ts.fake_quant(np.asarray(values[param], np.float32))).T
        np.testing.assert_array_equal(file_values.reshape(n_out, n_in), plan_values)


def test_blocks_beat_one_scale_per_channel_on_both_backends_alike(mlp):
    model, variables, data = mlp
    held_out = data[-1]
    reference = np.asarray(model.apply(variables, held_out))
    sqnr = {}
    for name, granularity in (("channel", odmlq.PerChannel()), ("block", odmlq.PerBlock(32))):
        rules = _rules(granularity)
        result = odmlq.export_tflite(model, rules, data, variables=variables)
        litert = litert_rows(result.tflite, held_out)
        xla = np.asarray(odmlq.ptq(model, rules, variables, result.calibration, example_inputs=(held_out[:1],))(held_out))
        sqnr[name] = _sqnr(reference, litert)
        # Same integers, scales (block scales that float16 and bfloat16 both hold:
        # the file's float16 read as bfloat16 by XNNPACK) and per-row input ranges:
        # apart only by float32 sums in another order.
        assert _sqnr(xla, litert) >= 90, name
        assert abs(_sqnr(reference, xla) - sqnr[name]) <= 0.5, name
    assert sqnr["block"] >= sqnr["channel"] + 3, sqnr


@pytest.mark.parametrize("rules, match", [
    ([R(".*", weight_qtype="int4", act_qtype="int8", weight_granularity=odmlq.PerBlock(128))],
     "inputs are not quantized per call"),
    ([R(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True, weight_granularity=odmlq.PerBlock(128))],
     "this weight is int8"),
    (_rules(odmlq.PerBlock(16)), "block size is 16"),
])
def test_blocks_no_litert_kernel_takes_are_refused_before_any_work(mlp, rules, match):
    model, variables, data = mlp
    with pytest.raises(odmlq.PlanError, match=rf"fc1.*LiteRT takes block scales only.*{match}.*PerChannel"):
        odmlq.export_tflite(model, rules, data, variables=variables)


def test_convolutions_in_blocks_are_refused():
    model, (x,), variables = cnn()
    rules = [R(".*", op="conv", weight_qtype="int8", act_qtype="int8", act_dynamic=True),
             R("dense1", weight_qtype="int4", act_qtype="int8", act_dynamic=True,
               weight_granularity=odmlq.PerBlock(32)),
             R(".*", weight_qtype="int4", act_qtype="int8", act_dynamic=True)]
    data = [np.random.default_rng(i).random((4, *x.shape[1:]), np.float32) for i in range(3)]
    result = odmlq.export_tflite(model, rules, data, variables=variables)
    assert any(t.block_size == 32 for t in result.summary.tensors)
    with pytest.raises(odmlq.PlanError, match=r"conv2.*this op is a 'conv'"):
        odmlq.export_tflite(model, [R("conv2", weight_qtype="int4", act_qtype="int8", act_dynamic=True,
                                      weight_granularity=odmlq.PerBlock(16, axis=2)), *rules], data,
                            variables=variables)


def test_bfloat16_scales_are_float16s_and_round_up_by_at_most_one_step():
    scale = np.geomspace(1e-9, 6e4, 2000).astype(np.float32)
    brain = bfloat16_up(scale)
    assert np.all(brain >= scale)
    assert np.all(brain.astype(np.float16).astype(np.float32) == brain)  # the file stores float16
    assert np.all(brain.astype(ml_dtypes.bfloat16).astype(np.float32) == brain)  # XNNPACK reads bfloat16
    normal = scale >= 2.0 ** -14
    assert np.all(brain[normal] <= scale[normal] * (1 + 2.0 ** -7) * (1 + 2.0 ** -10) * (1 + 1e-6))
    with pytest.raises(odmlq.PlanError, match="float16's range"):
        bfloat16_up(np.array([65500.0], np.float32))  # a float16, whose bfloat16 above is not


def test_float16_scales_round_up_by_at_most_one_step():
    scale = np.geomspace(1e-9, 6e4, 2000).astype(np.float32)
    half = float16_up(scale)
    assert np.all(half >= scale)
    assert np.all(half.astype(np.float16).astype(np.float32) == half)  # each is a float16
    normal = scale >= 2.0 ** -14
    assert np.all(half[normal] <= scale[normal] * (1 + 2.0 ** -10) * (1 + 1e-6))
    with pytest.raises(odmlq.PlanError, match="float16's range"):
        float16_up(np.array([7e4], np.float32))
