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


def test_a_zero_table_added_in_int16_reads_at_the_output_scale_and_exports():
    model, batches = _ZeroTable(), _batches()
    variables = model.init(jax.random.key(0), batches[0][:1])
    result = odmlq.export_tflite(model, INT16, batches, variables=variables, benchmark=False)
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
