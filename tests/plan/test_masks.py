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
