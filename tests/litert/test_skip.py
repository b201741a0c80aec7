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
