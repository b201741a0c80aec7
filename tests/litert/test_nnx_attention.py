"""Flax NNX's MultiHeadAttention, as a user writes it (nnx.LayerNorm before it,
a residual add, a mean-pooled head).

NNX computes the attention weights under `jax.vmap`, which moves the
softmax's axes: its jaxpr transposes the scores inside the softmax. Before,
the graph did not read that as a softmax: the int8 export refused its
stop_gradient ('no int8 kernel'), then litert-converter made an int8 SOFTMAX
whose output scale was not the 1/256 its kernel requires (the interpreter
refused the file). The dynamic-range export failed verification by twice the
range of the attention's output: its einsum was read from a tensor of the
same size in another layout. Now the softmax is one op (`graph._patterns`),
lowered in its canonical form (transpose, then softmax over the last axis).
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import odmlq


class _Encoder(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(num_heads=2, in_features=16, qkv_features=16, decode=False,
                                                rngs=rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        h = self.embed(x)
        h = h + self.attention(self.norm(h))
        return self.head(h.mean(1))


def _batches(n, seed):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((8, 6, 8)).astype(np.float32),) for _ in range(n)]


def test_the_softmax_under_vmap_is_one_op_over_the_last_axis():
    model = _Encoder(nnx.Rngs(0))
    plan = odmlq.plan(model, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")], _batches(1, 0)[0][0])
    softmax = [op for op in plan.graph.ops if op.kind == "softmax"]
    assert len(softmax) == 1, [op.kind for op in plan.graph.ops]
    assert not [op for op in plan.graph.ops if op.kind in ("stop_gradient", "exp", "reduce_max")]
    (op,) = softmax
    assert op.attributes["axis"] == len(plan.graph.edges[op.outputs[0]].shape) - 1


@pytest.mark.parametrize("schema", ["int8", "dynamic"])
def test_nnx_attention_exports_and_verifies(schema):
    model = _Encoder(nnx.Rngs(0))
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=schema == "dynamic")]
    result = odmlq.export_tflite(model, rules, _batches(4, 1), benchmark=False)
    assert result.verification.passed, str(result.verification)
    assert result.summary.float_islands == ()
    histogram = dict(result.summary.op_histogram)
    assert histogram.get("SOFTMAX") == 1, histogram
    if schema == "int8":
        # Full integer: the only float ops are the interface's QUANTIZE and DEQUANTIZE.
        assert result.summary.schema == "static", result.summary
    # The file equals simulate (verified above), and simulate runs the traced steps:
    # against float, int8 activations through attention keep at least 20 dB (measured 25.9).
    x = _batches(1, 7)[0][0]
    simulated = np.asarray(odmlq.simulate(model, result.plan, result.scales, x))
    reference = np.asarray(model(x), np.float64)
    assert 10 * np.log10(np.sum(reference ** 2) / np.sum((reference - simulated) ** 2)) > 20
