"""Attention masks: a sentinel (finfo(float32).min) is no data.

Hugging Face's Flax models add ``select(mask > 0, 0, finfo.min)`` to the
scores; Flax's attention writes ``where(mask, scores, finfo.min)``. Calibrated
as data the sentinel made a 1.3e36 scale (LiteRT aborted on it). The plan
calibrates the edges it reaches with `Masked`: the sentinel is left out of
the statistics and sits at the bottom of the range, so masked positions get
zero attention in the integer softmax too.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq
import odmlq.litert
from odmlq.calibration import Masked

RNG = np.random.RandomState(0)
X = RNG.randn(24, 6, 8).astype(np.float32)
MASK = np.ones((24, 6), np.int32)
MASK[:, 4:] = 0  # two padding positions in every row
MASK[::3, 3] = 0
INT8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


class Attention(nn.Module):
    style: str  # 'additive' (Hugging Face) or 'where' (Flax)

    @nn.compact
    def __call__(self, x, mask):
        q, k, v = (nn.Dense(8, name=n)(x) for n in "qkv")
        scores = jnp.einsum("bqd,bkd->bqk", q, k) / jnp.sqrt(8.0)
        keep = (mask > 0)[:, None, :]
        big_neg = jnp.finfo(jnp.float32).min
        if self.style == "additive":
            bias = jax.lax.select(jnp.broadcast_to(keep, scores.shape), jnp.zeros(scores.shape),
                                  jnp.full(scores.shape, big_neg))
            scores = scores + bias
        else:
            scores = jnp.where(keep, scores, big_neg)
        weights = jax.nn.softmax(scores)
        return nn.Dense(8, name="out")(jnp.einsum("bqk,bkd->bqd", weights, v))


@pytest.mark.parametrize("style", ["additive", "where"])
def test_a_masked_attention_exports_full_integer_and_masked_positions_get_nothing(style):
    model = Attention(style)
    variables = model.init(jax.random.PRNGKey(0), X[:1], MASK[:1])
    plan = odmlq.plan(model, INT8, X[:1], MASK[:1], variables=variables)
    masked = [e for e, p in plan.edges.items() if p.spec is not None and isinstance(p.spec.calibration, Masked)]
    assert masked, "no edge calibrated as masked"
    batches = [(X[i:i + 8], MASK[i:i + 8]) for i in range(0, 24, 8)]
    result = odmlq.export_tflite(model, INT8, batches, variables=variables, allow_float_ops=True)
    assert result.verification.passed
    assert all(np.isfinite(np.asarray(ts.scale)).all() and np.asarray(ts.scale).max() < 1e3
               for ts in result.scales.edges.values())
    softmax = next(e for e in plan.edges if e.endswith("softmax"))
    _, edges = odmlq.simulate(model, result.plan, result.scales, X, MASK, variables=variables, capture=True)
    weights = np.asarray(edges[softmax])
    np.testing.assert_array_equal(weights[np.broadcast_to(MASK[:, None, :] == 0, weights.shape)], 0.0)
    reference = np.asarray(model.apply(variables, X, MASK))
    quantized = np.asarray(odmlq.ptq(model, result.plan, variables, result.calibration)(X, MASK))
    sqnr = 10 * np.log10(np.sum(reference ** 2) / np.sum((reference - quantized) ** 2))
    assert sqnr >= 25.0, sqnr  # the zoo's floor for transformers


class FloatMaskAttention(nn.Module):
    """A mask made float (``mask.astype(float32)``, as `flax.linen.combine_masks`
    and Hugging Face's GPT-2 do) and compared back to bool before use."""

    compare: str  # 'gt' (GPT-2: mask > 0), 'ne' (mask != 0), 'where' (jnp.where(float mask, ...))

    @nn.compact
    def __call__(self, x, mask):
        q, k, v = (nn.Dense(8, name=n)(x) for n in "qkv")
        scores = jnp.einsum("bqd,bkd->bqk", q, k) / jnp.sqrt(8.0)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        keep = jnp.logical_and((mask > 0)[:, None, :], causal[None]).astype(jnp.float32)
        big_neg = jnp.finfo(jnp.float32).min
        if self.compare == "gt":
            scores = scores + jax.lax.select(keep > 0, jnp.zeros(scores.shape), jnp.full(scores.shape, big_neg))
        elif self.compare == "ne":
            scores = jnp.where(keep != 0, scores, big_neg)
        else:
            scores = jnp.where(keep, scores, big_neg)
        weights = jax.nn.softmax(scores)
        return nn.Dense(8, name="out")(jnp.einsum("bqk,bkd->bqd", weights, v))


@pytest.mark.parametrize("compare", ["gt", "ne", "where"])
def test_a_float_mask_compared_back_to_bool_needs_no_float_op(compare):
    """cast(mask) > 0 is the mask itself: the plan reads the bool mask, the cast
    (a float op with no integer kernel) is gone, and the model exports
    full-integer with no option; the float model's outputs are unchanged."""
    model = FloatMaskAttention(compare)
    variables = model.init(jax.random.PRNGKey(0), X[:1], MASK[:1])
    graph = odmlq.trace(model, X[:1], MASK[:1], variables=variables)
    assert not [op.id for op in graph.ops if op.kind == "convert_element_type"]
    np.testing.assert_array_equal(np.asarray(graph.evaluate(variables, X[:1], MASK[:1])),
                                  np.asarray(model.apply(variables, X[:1], MASK[:1])))
    batches = [(X[i:i + 8], MASK[i:i + 8]) for i in range(0, 24, 8)]
    result = odmlq.export_tflite(model, INT8, batches, variables=variables)
    assert result.verification.passed and result.summary.float_islands == ()
    reference = np.asarray(model.apply(variables, X, MASK))
    simulated = np.asarray(odmlq.simulate(model, result.plan, result.scales, X, MASK, variables=variables))
    sqnr = 10 * np.log10(np.sum(reference ** 2) / np.sum((reference - simulated) ** 2))
    assert sqnr >= 25.0, sqnr  # the zoo's floor for transformers


def test_a_float_mask_read_as_numbers_keeps_its_cast():
    """A float mask multiplied into the scores is a number, not a bool: the
    cast stays, a CAST where the mask enters the float domain as a model input
    does (quantized after it, no float island), and the export verifies."""

    class Multiplied(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            return nn.Dense(8)(x) * (mask > 0).astype(jnp.float32)[..., None]

    model = Multiplied()
    variables = model.init(jax.random.PRNGKey(0), X[:1], MASK[:1])
    graph = odmlq.trace(model, X[:1], MASK[:1], variables=variables)
    assert [op.kind for op in graph.ops].count("convert_element_type") == 1
    export = odmlq.export_tflite(model, INT8, [(X[:8], MASK[:8])], variables=variables, benchmark=False)
    assert export.summary.op_histogram.get("CAST") == 1 and export.summary.float_islands == ()
    assert export.verification.worst.max_lsb <= 1.001
