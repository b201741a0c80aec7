"""Ops computing from integer inputs only and read only by float ops run in float.

A rotary embedding's angle is ``positions * inv_freq``: an exact function of an
integer input. Quantized to int8 before the (skipped, float) SIN and COS, its
step is 1/127 of the largest position times the fastest frequency: at
positions up to 1000 that is ~8 radians, and SIN of it is noise. Planned from
the integers, the angle stays float (`FROM_INTEGERS`) and the export is as
good as the rest of the int8 model."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq
from odmlq.plan._passes import FROM_INTEGERS

HALF = 4


class _Rotary(nn.Module):
    @nn.compact
    def __call__(self, x, positions):
        inv_freq = 1.0 / (10000.0 ** (np.arange(HALF) / HALF))
        angle = positions[..., None].astype(jnp.float32) * inv_freq
        sin, cos = jnp.sin(angle), jnp.cos(angle)
        h = nn.Dense(2 * HALF, name="q")(x)
        a, b = h[..., :HALF], h[..., HALF:]
        return nn.Dense(4, name="out")(jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1))


RULES = [odmlq.Rule(".*", op=("sin", "cos"), skip=True),
         odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


def _data(seed, n=8):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((1, 6, 8)).astype(np.float32),
             rng.integers(0, 1000, (1, 6)).astype(np.int32)) for _ in range(n)]


def _sqnr_db(reference, value):
    reference, value = np.asarray(reference, np.float64), np.asarray(value, np.float64)
    return float(10 * np.log10(np.sum(reference ** 2) / np.sum((reference - value) ** 2)))


def test_a_rotary_angle_from_positions_is_planned_float():
    model, data = _Rotary(), _data(0)
    variables = model.init(jax.random.key(0), *data[0])
    plan = odmlq.plan(model, RULES, *data[0], variables=variables)
    angle = {e for op in plan.graph.ops if op.kind in ("sin", "cos") for e in op.inputs}
    assert len(angle) == 1, angle
    # The CAST of the positions and the multiply by the frequencies: float, skipped.
    for edge in ("convert_element_type", *angle):
        assert plan.edges[edge].spec is None and plan.edges[edge].reason.startswith(FROM_INTEGERS), plan.edges[edge]
        assert plan.ops[plan.graph.edges[edge].producer].skip
    # The rest of the model is int8 as its rule says.
    assert plan.edges["q/dot_general"].spec.qtype.name == "int8"


# SIN and COS kept float by a skip rule, or, with no rule for them, by LiteRT (it has no
# integer SIN: `OpPlan.inputs_float`, their angle read unquantized).
@pytest.mark.parametrize("rules", [RULES, RULES[1:]], ids=["skip_rule", "allow_float_ops"])
def test_a_rotary_angle_from_large_positions_exports_accurately(rules):
    model, data = _Rotary(), _data(0)
    variables = model.init(jax.random.key(0), *data[0])
    result = odmlq.export_tflite(model, rules, data, variables=variables, allow_float_ops=True, benchmark=False)
    assert result.verification.passed, str(result.verification)
    run = odmlq.litert.interpreter(result.tflite, num_threads=1).get_signature_runner()
    held_out = _data(1, 4)
    reference = np.concatenate([np.asarray(model.apply(variables, *batch)) for batch in held_out])
    exported = np.concatenate([run(x=x, positions=p)["output_0"] for x, p in held_out])
    # Two int8 Dense layers: 30.1 dB measured either way; with the angle quantized to
    # int8 before SIN and COS (the plan before this pass; without a skip rule, before
    # `inputs_float`) the same export measured -1.5 dB. 25 dB separates the two.
    assert _sqnr_db(reference, exported) >= 25


def test_an_op_litert_runs_in_float_reads_its_float_inputs_unconverted():
    model, data = _Rotary(), _data(0)
    variables = model.init(jax.random.key(0), *data[0])
    plan = odmlq.plan(model, RULES[1:], *data[0], variables=variables)
    assert [o for o, p in plan.ops.items() if p.inputs_float] == ["sin", "cos"]
    assert plan.edges["mul"].spec is None and plan.edges["mul"].reason.startswith(FROM_INTEGERS)
    assert not [c for c in plan.conversions.values() if c.edge == "mul"], plan.conversions
    assert plan.edges["sin"].spec.qtype.name == "int8"  # its output: as its rule says
    assert odmlq.Plan.from_json(plan.to_json()).ops["sin"].inputs_float
    # For XLA alone (every op has an integer form there) the angle is quantized by its rule.
    xla = odmlq.plan(model, RULES[1:], *data[0], variables=variables, target="xla")
    assert not any(p.inputs_float for p in xla.ops.values()) and xla.edges["mul"].spec is not None
