"""LiteRT's ADD rescales its inputs to its output through a multiplier below
1 (`odmlq.litert._multipliers`); an input of scale 1 (a range of zero) beside
small values broke it, and LiteRT aborted loading the file (transformers'
BEiT at int16, whose relative position bias tables initialize to zeros)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq

INT16 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int16")]


class _ZeroTable(nn.Module):
    """Small scores plus rows of a zero-initialized table picked at constant
    positions (a value derived from parameters, read where it is added)."""

    @nn.compact
    def __call__(self, x):
        scores = nn.Dense(8, name="scores")(x) * 1e-3
        table = self.param("table", nn.initializers.zeros, (5, 8))
        return scores + table[jnp.array([0, 2, 4, 1, 3, 0, 2, 4]) % 5, jnp.arange(8)]


class _DeadBranch(nn.Module):
    """An activation all zeros in calibration (a ReLU whose bias is -1000)
    added to small values."""

    @nn.compact
    def __call__(self, x):
        dead = nn.relu(nn.Dense(8, name="dead")(x) - 1000.0)
        return nn.Dense(8, name="small")(x) * 1e-3 + dead


def _batches(n=64, seed=0):
    x = np.random.default_rng(seed).normal(size=(n, 16)).astype(np.float32)
    return [x[i:i + 8] for i in range(0, n, 8)]


def _int16_export(model, **options):
    batches = _batches()
    variables = model.init(jax.random.key(0), batches[0][:1])
    return odmlq.export_tflite(model, INT16, batches, variables=variables, benchmark=False, **options)


def test_a_zero_table_added_in_int16_reads_at_the_output_scale_and_exports():
    result = _int16_export(_ZeroTable())
    assert result.verification.passed, str(result.verification)
    add = next(op for op in result.plan.graph.ops if op.kind == "add")
    derived = [ts for (op_id, _), ts in result.scales.derived.items() if op_id == add.id]
    # Read at the ADD's output scale (it was 1, the default for a range of zero:
    # an output multiplier of 2 / (2^15 * 3e-8), far over 1).
    assert derived and all(np.allclose(ts.scale, result.scales.edges[add.outputs[0]].scale) for ts in derived)


def test_an_int16_add_whose_multiplier_would_abort_litert_is_refused_by_name():
    model, batches = _DeadBranch(), _batches()
    variables = model.init(jax.random.key(0), batches[0][:1])
    with pytest.raises(odmlq.PlanError, match=r"op '[^']*add[^']*' .* LiteRT's int16 ADD rescales its inputs .* "
                                              r"scale 1 over an output scale of .* would abort loading"):
        odmlq.export_tflite(model, INT16, batches, variables=variables, benchmark=False)
    # int8 has 32x more room (a left shift of 20 bits, not 15): it exports.
    result = odmlq.export_tflite(model, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")], batches,
                                 variables=variables, benchmark=False)
    assert result.verification.passed, str(result.verification)


class _ZeroBias(nn.Module):
    """Small scores plus a constant bias of zeros: what a cross-attention's mask of
    ones folds to (transformers' GPT-2 decoder under a ViT encoder at int16)."""

    @nn.compact
    def __call__(self, x):
        scores = nn.Dense(8, name="scores")(x) * 1e-3
        return scores + jnp.where(jnp.ones((1, 8)) > 0, 0.0, jnp.finfo(jnp.float32).min)


def test_a_constant_bias_of_zeros_added_in_int16_reads_at_the_output_scale_and_exports():
    result = _int16_export(_ZeroBias())
    assert result.verification.passed, str(result.verification)
    add = next(op for op in result.plan.graph.ops if op.kind == "add")
    assert [o.role for o in add.operands] == ["input", "constant"]
    # Read at the ADD's output scale (it was 1, a constant's default for zeros, and
    # LiteRT aborted loading the file).
    np.testing.assert_allclose(result.scales.constants[(add.id, 0)].scale.ravel(),
                               result.scales.edges[add.outputs[0]].scale.ravel())


def test_the_multiplier_check_reads_a_constant_operand_by_its_index_among_constants():
    """The refusal looks the constant up as the scales key it (its index among the
    op's constants, 0 here, where it is operand 1): at scale 1 it must be refused."""
    import dataclasses

    from odmlq.litert._multipliers import check_add_multipliers

    result = _int16_export(_ZeroBias(), verify=False)
    add = next(op for op in result.plan.graph.ops if op.kind == "add")
    check_add_multipliers(result.plan, result.scales)  # as exported: in range
    unit = dataclasses.replace(result.scales.constants[(add.id, 0)],
                               scale=np.ones_like(result.scales.constants[(add.id, 0)].scale))
    scales = dataclasses.replace(result.scales, constants={**result.scales.constants, (add.id, 0): unit})
    with pytest.raises(odmlq.PlanError, match=r"its input constant operand 1 has scale 1 over an output scale"):
        check_add_multipliers(result.plan, scales)
