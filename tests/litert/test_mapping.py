"""Which .tflite tensor carries which plan edge (`odmlq.litert._mapping`), on
the converter's own naming.

diffusers' VAE attention (FlaxAttentionBlock: one head, Dense on the
flattened feature map, the heads' transpose a no-op) is the case: the
converter names the RESHAPE that lays each Dense's input out for
FULLY_CONNECTED after the Dense, and the FULLY_CONNECTED's output after the
transpose it absorbed. The Dense's edge was read from its input's copy,
and every export of the model failed verification ("scale/zero point ...
not the plan's").

A value computed twice (every ResNet block of diffusers' UNet applies
nn.swish to the same time embedding) is kept once by the converter: the
second computation's edges read the first one's tensor.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq
from odmlq.litert._mapping import layout_copies, map_tensors
from odmlq.litert.verify import preserving_interpreter


class _OneHeadAttention(nn.Module):
    """As diffusers' FlaxAttentionBlock computes it (written out: diffusers is not
    a test dependency), after a convolution."""

    channels: int = 16

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(self.channels, (3, 3), name="conv")(x)
        batch, height, width, channels = x.shape
        h = x.reshape((batch, height * width, channels))

        def heads(p):  # (B, T, C) -> (B, 1, T, C)
            return jnp.transpose(p.reshape(p.shape[:-1] + (1, -1)), (0, 2, 1, 3))

        q, k, v = (heads(nn.Dense(channels, name=n)(h)) for n in ("query", "key", "value"))
        scale = 1 / math.sqrt(math.sqrt(channels))
        weights = nn.softmax(jnp.einsum("...qc,...kc->...qk", q * scale, k * scale), axis=-1)
        h = jnp.einsum("...kc,...qk->...qc", v, weights)
        h = jnp.transpose(h, (0, 2, 1, 3)).reshape((batch, height * width, channels))
        h = nn.Dense(channels, name="proj")(h)
        return h.reshape((batch, height, width, channels)) + x


def _batches(n, seed):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((8, 8, 8, 3)).astype(np.float32),) for _ in range(n)]


def test_one_head_attention_exports_int8_and_every_dense_is_checked_at_its_output():
    model = _OneHeadAttention()
    variables = model.init(jax.random.key(0), _batches(1, 0)[0][0][:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    result = odmlq.export_tflite(model, rules, _batches(4, 1), variables=variables, benchmark=False)
    assert result.verification.passed, str(result.verification)
    interpreter = preserving_interpreter(result.tflite)
    details = interpreter.get_tensor_details()
    ops = interpreter._get_ops_details()
    mapping = map_tensors(details, {int(t) for op in ops for t in op["outputs"]}, result.plan, result.scales,
                          ops=ops)
    copies = layout_copies(ops, details)
    # The Dense inputs' RESHAPEs, named for the Dense, are copies and carry no Dense edge.
    named_for_dense = [d["index"] for d in details if "/query/dot_general" in d["name"] and d["index"] in copies]
    assert named_for_dense, [d["name"] for d in details]
    assert not set(named_for_dense) & set(mapping.values())
    # What a FULLY_CONNECTED writes is checked: under the transpose it absorbed, if not its own edge.
    fc_outputs = {int(op["outputs"][0]) for op in ops if op["op_name"] == "FULLY_CONNECTED"}
    assert len(fc_outputs) == 4 and fc_outputs <= set(mapping.values()), (fc_outputs, mapping)


def test_one_head_attention_exports_dynamic_range_and_verifies():
    """Float tensors too: the RESHAPE named for the value projection holds its
    input; simulate fed it as the projection's output missed by 1.8x its range."""
    model = _OneHeadAttention()
    variables = model.init(jax.random.key(0), _batches(1, 0)[0][0][:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)]
    result = odmlq.export_tflite(model, rules, _batches(2, 1), variables=variables, benchmark=False)
    assert result.verification.passed, str(result.verification)
    assert result.summary.schema == "dynamic"


def test_attention_in_int16_reads_the_value_projection_after_a_separator():
    """The attention matmuls and softmax in int16 (their int8 softmax output is
    1/256 per LSB: over 64 keys, near-uniform weights are a few LSB each), the
    projections int8. The value's transpose is a no-op the converter drops, so
    its int16 conversion would fold into the FULLY_CONNECTED (int8 in, int16 out,
    not the plan's scale): it is read after a same-scale MAXIMUM, as a
    projection's own output is (`spec.sets_own_scale`)."""
    model = _OneHeadAttention()
    variables = model.init(jax.random.key(0), _batches(1, 0)[0][0][:1])
    rules = [odmlq.Rule(".*", op=("softmax", "einsum"), weight_qtype="int8", act_qtype="int16"),
             odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    result = odmlq.export_tflite(model, rules, _batches(4, 1), variables=variables, benchmark=False)
    assert result.verification.passed, str(result.verification)
    ops = preserving_interpreter(result.tflite)._get_ops_details()
    # Before the int16 query, key and value, and before the int8 copy of the context.
    assert [op["op_name"] for op in ops].count("MAXIMUM") == 4


def _detail(index, name, scale, zero_point=0, dtype=np.int8):
    return {"index": index, "name": name, "shape": np.array([1, 4]), "dtype": dtype,
            "quantization_parameters": {"scales": np.array([scale]), "zero_points": np.array([zero_point])}}


def test_a_layout_copy_keeps_its_input_params_and_anything_else_is_no_copy():
    details = [_detail(0, "a", 0.5, 3), _detail(1, "b", 0.5, 3), _detail(2, "c", 0.25, 3),
               _detail(3, "d", 0.5, 3, np.int16)]
    ops = [{"op_name": "RESHAPE", "inputs": [0, 9], "outputs": [1]},
           {"op_name": "RESHAPE", "inputs": [0, 9], "outputs": [2]},  # requantized: no copy
           {"op_name": "EXPAND_DIMS", "inputs": [0, 9], "outputs": [3]},  # another dtype
           {"op_name": "TANH", "inputs": [1], "outputs": [0]}]
    assert layout_copies(ops, details) == {1}


class _SwishTwice(nn.Module):
    """Each block applies nn.swish to the same embedding, as every ResNet block of
    diffusers' Flax UNet does to the time embedding: litert-converter keeps one
    LOGISTIC and one MUL, and all three Dense layers read them."""

    @nn.compact
    def __call__(self, x):
        embedding = nn.Dense(64, name="embedding")(x)
        first, second, third = (nn.Dense(48, name=n)(nn.swish(embedding)) for n in ("first", "second", "third"))
        return first * 0.5 + third + second


def test_a_computation_the_converter_keeps_once_is_checked_through_its_one_tensor():
    """The repeated SiLU's edges have no tensor of their own. Before, simulate
    computed them itself, from its own int16 sigmoid (2 LSB from LiteRT's table),
    and the Dense layers reading them were checked against inputs LiteRT never
    read: 0.12 LSB mean difference where the first Dense, fed what its kernel
    read, showed 0.003 (a 2-LSB failure on diffusers' UNet in int16x8). Now they
    are fed the one tensor, and every Dense differs only where its
    requantization rounds a near-tie: at most 0.02 LSB on average."""
    model = _SwishTwice()
    rng = np.random.default_rng(0)
    batches = [(3 * rng.standard_normal((16, 32)).astype(np.float32),) for _ in range(4)]
    variables = model.init(jax.random.key(0), batches[0][0][:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int16")]
    result = odmlq.export_tflite(model, rules, batches, variables=variables, benchmark=False)
    report = result.verification
    assert report.passed and not report.unmapped_edges, str(report)
    tensor = {c.edge: c.tensor for c in report.checks}
    for repeat in ("_1", "_2"):
        assert tensor[f"embedding/logistic{repeat}"] == tensor["embedding/logistic"], str(report)
        assert tensor[f"embedding/mul{repeat}"] == tensor["embedding/mul"], str(report)
    dense = {c.edge: c.mean_lsb for c in report.checks if c.edge.endswith("/dot_general")}
    assert all(mean <= 0.02 for mean in dense.values()), dense


def test_repeated_edges_are_the_same_primitives_on_the_same_operands():
    def f(params, x):
        w = params["w"]
        a, b = jnp.tanh(x), jnp.tanh(x)  # a repeat
        c, d = a * x, x * b  # the same values, but in another operand order: not read as a repeat
        left, right = x[:, :4], x[:, 4:]  # same primitive, other parameters
        scaled, other = x * 2.0, x * 3.0  # other literals
        return jnp.concatenate([c + d, left + right, scaled + other, (a + 1.0) @ w, (b + 1.0) @ w], axis=1)

    x, w = np.ones((2, 8), np.float32), np.ones((8, 4), np.float32)
    graph = odmlq.graph.trace(f, x, variables={"w": w})
    repeated = odmlq.graph.repeated_edges(graph)
    names = {op.outputs[0]: op.kind for op in graph.ops}
    kinds = sorted(names[e] for e in repeated)
    # tanh, then what reads it alone: the + 1.0 and the matmul after it.
    assert kinds == ["add", "dot_general", "tanh"], (repeated, names)
    assert all(names[e] == names[earlier] for e, earlier in repeated.items())


@pytest.mark.parametrize("activation", [
    jax.nn.elu,  # ends in a SELECT the converter names "select_n": no location
    jax.nn.sparse_plus,  # two of them
    lambda h: jax.nn.logsumexp(h, axis=-1, keepdims=True) + h,  # a bool edge named like a float tensor
])
def test_dynamic_range_activations_are_checked_at_the_tensor_their_reader_reads(activation):
    """Before: elu and sparse_plus failed verification by 100% and 180% of their
    range (their edges read from the EXP or the square inside them, not from the
    SELECT after), and logsumexp crashed in simulate (its is-finite mask fed a
    float tensor). The output Dense is now checked at the model's output tensor."""

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, name="last")(activation(nn.Dense(16, name="first")(x)))

    model = Model()
    rng = np.random.default_rng(0)
    batches = [(2 * rng.standard_normal((8, 12)).astype(np.float32),) for _ in range(4)]
    variables = model.init(jax.random.key(0), batches[0][0][:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)]
    report = odmlq.export_tflite(model, rules, batches, variables=variables, benchmark=False).verification
    assert report.passed, str(report)
    checked = {c.edge: c.max_lsb for c in report.checks}
    assert "last/dot_general" in checked, str(report)
    # float32 rounding of the same kernels' order of operations: ~1e-7 of the range
    assert max(checked.values()) <= 1e-6, str(report)
