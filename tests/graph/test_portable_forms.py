"""Ops traced into forms every backend runs in integers, the values unchanged
(`odmlq/graph/_canonical.py`), and block scales of tables.

Each was met in a transformers Flax model (Llama, Gemma, Mistral, GPT-Neo) and
ended its full-integer export: NEG, SiLU's LOGISTIC and MUL, and BROADCAST_TO
stayed float; XOR did not convert; ``x ** 2`` had no kernel. Here each is
exported alone between two quantized matmuls (JAX's ``stack`` primitive too,
which GPT-J's rotary embedding ends, and which the op table had no entry for): no float island, every op
within its tolerance of simulate (the export's own op-by-op verification). A nearest
resize's gather (XNNPACK takes no GATHER_ND) is a repeat of copies.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq
from odmlq.graph import trace

INT8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


class _Between(nn.Module):
    """Dense, `fn`, Dense."""

    fn: object
    features: int = 16

    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="out")(self.fn(nn.Dense(self.features, name="fc")(x)))


def _rotate_half(x):
    return jnp.concatenate([-x[..., 8:], x[..., :8]], axis=-1)


def _repeat_heads(x):  # (batch, 4 heads of 4) -> each head twice, as grouped-query attention does
    return jnp.repeat(x.reshape(x.shape[0], 4, 1, 4), 2, axis=2).reshape(x.shape[0], 32)


def _xor_mask(x):  # a local-attention mask built from two constant masks
    causal = np.tril(np.ones((16, 16), bool))
    window = np.triu(np.ones((16, 16), bool), -4)
    return x @ jnp.where(jnp.logical_xor(causal, ~window), 0.0, 1.0) * 0.1


def _interleave(x):  # GPT-J's rotary: (-x2, x1) of each pair, stacked on a last axis and flattened
    return jnp.stack([-x[..., 1::2], x[..., ::2]], axis=-1).reshape(x.shape)


CASES = {
    "neg": (_rotate_half, {"mul"}, "neg"),
    "square": (lambda x: x * jax.lax.rsqrt(jnp.mean(jnp.power(x, 2), -1, keepdims=True) + 1e-6), {"square"},
               "integer_pow"),
    "silu": (nn.silu, {"logistic", "mul"}, "silu"),
    "repeat": (_repeat_heads, {"concatenate"}, "broadcast_in_dim copying"),
    "xor": (_xor_mask, {"dot_general"}, "xor"),
    # 17 copies, past the concatenation's 16: a MUL by a (1, 17, 1) constant of ones.
    "broadcast": (lambda x: jnp.broadcast_to(x[:, None, :], (x.shape[0], 17, 16)).reshape(x.shape[0], -1),
                  {"mul"}, "broadcast_in_dim copying"),
    "stack": (_interleave, {"concatenate"}, "stack"),
    # Nearest 2x (a gather at positions 0, 0, 1, 1, ..): the copies concatenated, no GATHER_ND.
    "nearest": (lambda x: jax.image.resize(x, (x.shape[0], 32), "nearest"), {"concatenate"}, "gather"),
    # 3x: three copies (past 16 copies the broadcast's MUL by ones, as above).
    "nearest_3x": (lambda x: jax.image.resize(x, (x.shape[0], 48), "nearest"), {"concatenate"}, "gather"),
    # Consecutive constant positions: a slice.
    "take_run": (lambda x: jnp.take(x, np.arange(3, 13), axis=1), {"slice"}, "gather"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_traced_in_integer_forms_and_exported_full_integer(name):
    fn, kinds, gone = CASES[name]
    model = _Between(fn)
    x = np.random.default_rng(0).normal(size=(64, 12)).astype(np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    graph = trace(model, x, variables=variables)
    found = {op.kind for op in graph.ops}
    assert kinds <= found, found
    assert gone.split()[0] not in found or gone.endswith("copying"), found
    result = odmlq.export_tflite(model, INT8, [x[:32], x[32:]], variables=variables, benchmark=False)
    assert result.summary.float_islands == (), [o.name for o in result.summary.float_islands]
    assert result.verification.passed, str(result.verification)
    np.testing.assert_allclose(graph.evaluate(variables, x), model.apply(variables, x), rtol=0, atol=0)


def test_a_broadcast_of_many_copies_is_an_int16_mul_too():
    """The MUL by ones is an int16 kernel as well: int16x8, no float island, verified."""
    model = _Between(CASES["broadcast"][0])
    x = np.random.default_rng(0).normal(size=(64, 12)).astype(np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int16")]
    result = odmlq.export_tflite(model, rules, [x[:32], x[32:]], variables=variables, benchmark=False)
    assert result.summary.float_islands == (), [o.name for o in result.summary.float_islands]
    assert "MUL" in dict(result.summary.op_histogram) and "BROADCAST_TO" not in dict(result.summary.op_histogram)
    assert result.verification.passed, str(result.verification)


class _Resized(nn.Module):
    """Conv, nearest resize of the feature map (2x rows, 3x columns), Conv."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3), name="conv0")(x))
        b, h, w, c = x.shape
        return nn.Conv(4, (3, 3), name="conv1")(jax.image.resize(x, (b, 2 * h, 3 * w, c), "nearest"))


@pytest.mark.parametrize("act_qtype", ["int8", "int16"])
def test_a_nearest_resize_of_a_feature_map_runs_on_xnnpack_in_one_partition(act_qtype):
    """Both resized axes become copies (no GATHER_ND, which XNNPACK does not take and
    litert-converter 0.5.0 refuses in int16): int8 in one XNNPACK partition, int16x8
    full integer (it was refused), verified op by op; simulate equals the float model's
    resize exactly on the graph."""
    model = _Resized()
    x = np.random.default_rng(1).normal(size=(16, 8, 8, 3)).astype(np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    graph = trace(model, x, variables=variables)
    assert "gather" not in {op.kind for op in graph.ops}
    np.testing.assert_allclose(graph.evaluate(variables, x), model.apply(variables, x), rtol=0, atol=0)
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype=act_qtype)]
    result = odmlq.export_tflite(model, rules, [x[:8], x[8:]], variables=variables, benchmark=False)
    assert result.summary.float_islands == (), [o.name for o in result.summary.float_islands]
    assert "GATHER_ND" not in dict(result.summary.op_histogram)
    assert result.verification.passed, str(result.verification)
    if act_qtype == "int8":
        assert result.delegation.partitions == 1 and not result.delegation.outside, str(result.delegation)


def test_a_gather_at_other_constant_positions_stays_a_gather():
    """Positions that neither repeat in order nor run consecutively (0, 0, 1, 3, 2):
    the gather is kept, and its values are the model's."""
    def fn(params, x):
        return jnp.take(x, np.array([0, 0, 1, 3, 2]), axis=1) * params["a"]

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    params = {"a": np.float32(2.0)}
    graph = trace(fn, x, variables=params)
    assert "gather" in {op.kind for op in graph.ops}
    np.testing.assert_array_equal(np.asarray(graph.evaluate(params, x)), np.asarray(fn(params, x)))


class _TiedLM(nn.Module):
    """An embedding table read by its lookup and, transposed, by the output projection."""

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(100, 64, name="embed")
        h = nn.Dense(64, name="fc")(embed(tokens))
        return embed.attend(h)


def test_blocks_of_a_table_run_along_its_rows_for_lookup_and_tied_projection():
    """PerBlock(32) on a (vocab 100, 64) table: blocks along each row (the axis
    the tied projection contracts), a scale per row and block, though 32 does not
    divide the vocabulary (the projection reads the table transposed)."""
    model = _TiedLM()
    tokens = np.random.default_rng(2).integers(0, 100, size=(4, 8)).astype(np.int32)
    variables = model.init(jax.random.key(0), tokens[:1])
    rules = [odmlq.Rule(".*", weight_qtype="int4", weight_granularity=odmlq.PerBlock(32))]
    plan = odmlq.plan(model, rules, tokens[:1], variables=variables, target="xla")
    spec = plan.weight_specs()["embed/embedding"]
    assert (spec.block_axis, spec.block_size, spec.scale_axes) == (1, 32, (0,))
    qmodel = odmlq.ptq(model, plan, variables)
    assert qmodel.params["params"]["embed"]["embedding"].scale.shape == (100, 2)
    reference = np.asarray(model.apply(variables, tokens))
    error = np.asarray(qmodel(tokens)) - reference
    # int4 weights at 4 bits of 32-wide blocks on random weights: about 18 dB; 12 dB is a collapse's margin.
    assert 10 * np.log10(np.sum(reference ** 2) / np.sum(error ** 2)) >= 12.0


@pytest.mark.parametrize("compare", [
    lambda f: f != 0, lambda f: f > 0, lambda f: 0 < f, lambda f: 0 > f, lambda f: f < 0,
    lambda f: f.astype(bool)], ids=["ne", "gt", "zero_lt", "zero_gt", "lt", "to_bool"])
def test_an_integer_made_float_and_compared_with_zero_is_compared_as_integers(compare):
    """``cast(m) != 0`` (and > 0, 0 < m, 0 > m, < 0, a cast to bool) of an int32 input: the
    traced comparison reads the integers, the float cast is gone, the values equal."""
    def fn(params, m):
        return jnp.where(compare(m.astype(jnp.float32)), params["a"], -2.0)

    m = np.array([[3, 0, -2, 1, 0, 7]], np.int32)
    params = {"a": np.float32(1.5)}
    graph = trace(fn, m, variables=params)
    assert not any(op.kind == "convert_element_type" for op in graph.ops), [op.kind for op in graph.ops]
    compares = [op for op in graph.ops if op.kind in ("ne", "gt", "lt")]
    assert compares and all(graph.edges[graph.resolve(e)].dtype == "int32" for op in compares for e in op.inputs)
    other = np.array([[-1, 5, 0, 0, 2, -9]], np.int32)
    np.testing.assert_array_equal(np.asarray(graph.evaluate(params, other)), np.asarray(fn(params, other)))


def test_a_literal_dividend_is_traced_and_exported_full_integer():
    """``1.0 / x``: jax 0.10 gives the literal 1.0 as a TypedNdArray, which numpy's
    rules leave unhashable; the trace's rewrite of divisions hashed it and ended
    in a bare TypeError (BigBird's ``1.0 / jnp.sqrt(...)`` did). Now it exports:
    no float island, every op within its tolerance of simulate."""
    model = _Between(lambda x: 1.0 / (1.0 + x * x))
    x = np.random.default_rng(0).normal(size=(64, 12)).astype(np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    graph = trace(model, x, variables=variables)
    assert "div" in {op.kind for op in graph.ops}
    np.testing.assert_allclose(graph.evaluate(variables, x), model.apply(variables, x), rtol=0, atol=0)
    result = odmlq.export_tflite(model, INT8, [x[:32], x[32:]], variables=variables, benchmark=False)
    assert result.summary.float_islands == (), [o.name for o in result.summary.float_islands]
    assert result.verification.passed, str(result.verification)
