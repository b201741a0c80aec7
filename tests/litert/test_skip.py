"""Skip rules are honoured: an op a rule keeps in float runs in float in the
.tflite. litert-converter quantizes a lone float op between a DEQUANTIZE and
a QUANTIZE (seen: a skipped tanh became an int8 TANH; a skipped relu and
maximum failed verification); odmlq keeps such ops float."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq
from tests._runs import litert_rows

X = np.random.RandomState(0).randn(32, 8).astype(np.float32)
CASES = {  # activation -> (op kind in the plan, LiteRT op)
    "tanh": (jnp.tanh, "tanh", "TANH"),
    "relu": (nn.relu, "relu", "RELU"),
    "gelu": (nn.gelu, "gelu", "GELU"),
    "sigmoid": (nn.sigmoid, "logistic", "LOGISTIC"),
    "maximum": (lambda v: jnp.maximum(v, 0.1), "max", "MAXIMUM"),
}


class Net(nn.Module):
    activation: str

    @nn.compact
    def __call__(self, x):
        h = CASES[self.activation][0](nn.Dense(16, name="a")(x))
        return nn.Dense(4, name="b")(h)


@pytest.mark.parametrize("activation", sorted(CASES))
def test_a_skipped_op_between_quantized_ops_stays_float(activation):
    model = Net(activation)
    variables = model.init(jax.random.PRNGKey(0), X[:1])
    _, kind, litert_op = CASES[activation]
    rules = [odmlq.Rule(".*", op=kind, skip=True), odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    with pytest.warns(UserWarning, match="float ops in the exported model"):
        result = odmlq.export_tflite(model, rules, [X[:16], X[16:]], variables=variables, allow_float_ops=True)
    summary = result.summary
    ops = [op for op in summary.ops if op.name == litert_op]
    assert len(ops) == 1, summary.op_histogram
    assert all(summary.tensors[t].dtype == "float32" for t in ops[0].inputs + ops[0].outputs if t >= 0)
    assert [op.name for op in summary.ops if op.name == "FULLY_CONNECTED"] == ["FULLY_CONNECTED"] * 2
    assert all(summary.tensors[t].dtype == "int8" for op in summary.ops if op.name == "FULLY_CONNECTED"
               for t in op.outputs)
    assert result.verification.passed


class FoldedThenRelu6(nn.Module):
    """conv -> inference BatchNorm -> relu6 in a block (as EfficientNet's), then a
    conv: a BatchNorm that spreads the pre-activation far past relu6's [0, 6]
    (scale 20, shift -30)."""

    @nn.compact
    def __call__(self, x):
        return nn.Conv(4, (1, 1), name="second")(_Block(name="block")(x))


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jax.nn.relu6(nn.BatchNorm(use_running_average=True, name="bn")(nn.Conv(8, (3, 3), name="first")(x)))


def test_the_activation_of_a_skipped_convolution_stays_float_with_it():
    """Skipping a convolution keeps the relu6 its kernel applies in float too;
    quantized alone, the relu6 read its input requantized at the BatchNorm's
    wide range (EfficientNet-Lite0 with its first depthwise convolution
    skipped: 7.9 dB at the logits, 24.1 dB with this)."""
    model = FoldedThenRelu6()
    images = np.random.RandomState(1).rand(24, 8, 8, 3).astype(np.float32)
    variables = model.init(jax.random.PRNGKey(0), images[:1])
    params = variables["params"]
    variables = {"params": {**params, "block": {**params["block"], "bn": {"scale": jnp.full((8,), 20.0),
                                                                            "bias": jnp.full((8,), -30.0)}}},
                 "batch_stats": variables["batch_stats"]}
    rules = [odmlq.Rule("block/first", skip=True), odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    plan = odmlq.plan(model, rules, images[:1], variables=variables)
    relu6 = next(op for op in plan.graph.ops if op.kind == "relu6")
    assert plan.ops[relu6.id].skip and plan.ops[relu6.id].rule == 1
    assert "float producer's kernel applies" in plan.edges[relu6.outputs[0]].reason
    assert relu6.id in plan.float_ops

    with pytest.warns(UserWarning, match="float ops in the exported model"):
        result = odmlq.export_tflite(model, rules, [images[:8], images[8:16]], variables=variables,
                                     allow_float_ops=True)
    assert result.verification.passed
    summary = result.summary
    second = [op for op in summary.ops if op.name == "CONV_2D" and summary.tensors[op.inputs[0]].dtype == "int8"]
    assert len(second) == 1, summary.op_histogram
    # The int8 conv reads relu6's output on relu6's own grid ([0, 6] and the calibration's
    # headroom over 255 steps: 0.029), not on the pre-activation's (about 100 wide: 0.39 a step).
    step = summary.tensors[second[0].inputs[0]].scales[0]
    assert step <= 8.0 / 255, step
    got = litert_rows(result.tflite, images[16:])
    want = np.asarray(model.apply(variables, images[16:]))
    sqnr = 10 * np.log10(np.sum(want ** 2) / np.sum((np.asarray(got) - want) ** 2))
    # Measured 40.4 dB; the relu6 quantized alone on the wide grid gave 30.2 dB. The 4 dB margin
    # is for other hosts' float rounding; the old plan fails it by 6.
    assert sqnr > 36, sqnr


def test_a_weight_dequantized_at_run_time_is_refused_naming_the_rule_that_fixes_it():
    """A weight-only rule inside a full-integer model leaves a DEQUANTIZE of the
    weight (named after the parameter, 'b/kernel'); the refusal's rule names the
    module ('b'), and following it exports."""
    model = Net("relu")
    variables = model.init(jax.random.PRNGKey(0), X[:1])
    int8 = odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")
    with pytest.raises(odmlq.litert.FloatOpsError, match=r"DEQUANTIZE \(module 'b/kernel'\).*Rule\('b', skip=True\)"):
        odmlq.export_tflite(model, [odmlq.Rule("b", weight_qtype="int8"), int8], [X[:16], X[16:]],
                            variables=variables)
    with pytest.warns(UserWarning, match="float ops in the exported model"):
        result = odmlq.export_tflite(model, [odmlq.Rule("b", skip=True), int8], [X[:16], X[16:]],
                                     variables=variables, allow_float_ops=True)
    assert result.verification.passed
