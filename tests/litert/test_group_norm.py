"""GroupNorm, as Flax writes it (diffusers' VAE and U-Nets are built on it), on
LiteRT in int8 and int16x8.

`flax.linen.GroupNorm` views (N, H, W, C) as (N, H, W, groups, C / groups),
squares that view and broadcasts each group's statistics back with a reshape.
In int16, litert-converter 0.5.0 moves such a reshape past the MUL that squares
it, or past the ADD of the epsilon, and then fails ("'tfl.reshape' op
quantization parameters violate the same scale constraint", "'tfl.add' op
failed to verify that Operands should have valid shapes"): every int16x8
export of a GroupNorm failed. The export reads that operand through a
same-scale MAXIMUM (`_annotate.Annotation._read_after_layout`), the identity
on its grid.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import odmlq
from odmlq.litert._tolerance import allowed_lsb
from tests.litert.test_int16_forms import _sqnr_db


class _GroupNormCNN(nn.Module):
    """Residual blocks of GroupNorm, SiLU and a 3x3 convolution (a diffusion U-Net's)."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(16, (3, 3), name="stem")(x)
        for i in range(2):
            h = nn.Conv(16, (3, 3), name=f"conv{i}")(nn.swish(nn.GroupNorm(4, name=f"norm{i}")(x)))
            x = x + h
        return nn.Conv(3, (3, 3), name="head")(nn.swish(nn.GroupNorm(4, name="norm_out")(x)))


class _Statistics(nn.Module):
    """One piece of Flax's GroupNorm: a square of the grouped view, or the
    epsilon added to a group statistic reshaped for broadcasting."""

    form: str

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 3))(x)
        n, h, w, c = x.shape
        grouped = x.reshape(n, h, w, 4, c // 4)
        if self.form == "square":
            return jnp.mean(lax.square(grouped), axis=(1, 2, 4))
        if self.form == "self_add":
            return grouped + grouped
        return jnp.mean(grouped, axis=(1, 2, 4)).reshape(n, 1, 1, 4) + 1e-6


def _batches(n, seed, size=8):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((8, size, size, 3)).astype(np.float32) for _ in range(n)]


def _randomized(variables):
    """GroupNorm scales and biases away from Flax's ones and zeros."""
    rng = np.random.default_rng(7)

    def move(path, a):
        name = jax.tree_util.keystr(path)
        if "norm" in name and "scale" in name:
            return (a * rng.uniform(0.5, 1.5, a.shape)).astype(np.float32)
        if "norm" in name and "bias" in name:
            return (a + 0.2 * rng.standard_normal(a.shape)).astype(np.float32)
        return a
    return jax.tree_util.tree_map_with_path(move, variables)


@pytest.mark.parametrize("act_qtype, floor_db", [("int8", 20.0), ("int16", 40.0)])
def test_flax_group_norm_exports_full_integer_and_verifies(act_qtype, floor_db):
    model = _GroupNormCNN()
    variables = _randomized(model.init(jax.random.key(0), _batches(1, 0)[0][:1]))
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype=act_qtype)]
    result = odmlq.export_tflite(model, rules, _batches(4, 1), variables=variables, benchmark=False)
    assert result.verification.passed, str(result.verification)
    assert result.summary.float_islands == ()
    (held_out,) = _batches(1, 99)
    reference = np.asarray(model.apply(variables, held_out))
    simulated = np.asarray(odmlq.simulate(model, result.plan, result.scales, held_out, variables=variables))
    # Measured 26.6 dB (int8) and 43.9 dB (int16x8); the floors leave 4-6 dB for other
    # seeds and catch a statistic that lost its group (under 10 dB).
    assert _sqnr_db(reference, simulated) >= floor_db


@pytest.mark.parametrize("form", ["square", "self_add", "epsilon"])
def test_an_int16_op_after_a_grouping_reshape_exports_and_verifies(form):
    model = _Statistics(form)
    variables = model.init(jax.random.key(0), _batches(1, 0)[0][:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int16")]
    result = odmlq.export_tflite(model, rules, _batches(4, 1), variables=variables, benchmark=False)
    assert result.verification.passed, str(result.verification)
    assert result.summary.float_islands == ()
    assert "MAXIMUM" in result.summary.op_histogram  # the separator


class _Softmax(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.softmax(nn.Dense(x.shape[-1])(x), axis=-1)


@pytest.mark.parametrize("keys, expected", [(16, 128.0), (64, 128.0), (256, 512.0), (1024, 2048.0)])
def test_int16_softmax_tolerance_grows_with_its_keys(keys, expected):
    """LiteRT's int16 SOFTMAX sums N table lookups: measured up to 28 / 119 / 464 /
    1812 LSB over 16 / 64 / 256 / 1024 keys where one key dominates. The allowance
    is the op table's 128 LSB or 2 LSB per key, whichever is larger."""
    model = _Softmax()
    x = np.zeros((1, 2, keys), np.float32)
    variables = model.init(jax.random.key(0), x)
    plan = odmlq.plan(model, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int16")], x, variables=variables)
    scales = odmlq.compute_scales(plan, odmlq.calibrate(model, plan, [(x,)], variables=variables), variables)
    (softmax,) = [o.outputs[0] for o in plan.graph.ops if o.kind == "softmax"]
    assert allowed_lsb(plan, scales, softmax, 1.0, 0.0) == pytest.approx(expected)
