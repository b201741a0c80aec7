"""ptq on mixed activation qtypes: an op reads an input of another qtype through
a conversion (`Plan.conversions`), at the conversion's scale, as simulate does.

Tolerances: static edges are on their grids in both runs and may differ only
where int32 and float32 accumulation round a tie differently: at most 1 LSB of
the edge's scale (seen: 0 on every case). Reading an input at its edge's own
scale (or in float) instead of the conversion's moves each input by at most
half a conversion step, which pushes only some outputs across a rounding
boundary, by 1 LSB (seen: 9-13% of outputs, 36% behind the int16 add): inside
that tolerance. So the tests also count outputs equal to simulate's (seen:
all of them; floor 99%) and check that a simulate run without conversions is
not that close (floor: 5% of outputs differ).
"""

import contextlib
import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq
from odmlq.errors import PlanError
from odmlq.scales import compute_scales
from odmlq.xla import QuantizedModel
from tests._runs import litert_rows

R = odmlq.Rule


class _Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="b")(jnp.tanh(nn.Dense(32, name="a")(x)))


class _Conv(nn.Module):
    @nn.compact
    def __call__(self, x):
        # 'SAME' padding on b: an asymmetric converted input is padded with its zero point.
        return nn.Conv(4, (3, 3), name="b")(jnp.tanh(nn.Conv(8, (3, 3), name="a")(x)))


class _Residual(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32, name="a")(x)
        h = h + nn.Dense(32, name="c")(h)
        return nn.Dense(8, name="b")(h)


MODELS = {
    "dense": (_Dense, np.random.RandomState(0).randn(64, 16).astype(np.float32)),
    "conv": (_Conv, np.random.RandomState(1).randn(32, 8, 8, 3).astype(np.float32)),
    "residual": (_Residual, np.random.RandomState(2).randn(64, 16).astype(np.float32)),
}
INT8 = R(".*", weight_qtype="int8", act_qtype="int8")
RULES = {
    "int8-into-int16": [R("b", weight_qtype="int8", act_qtype="int16"), INT8],
    "int16-into-int8": [R("a", weight_qtype="int8", act_qtype="int16"), INT8],
    "float-into-int8": [R("a", skip=True), INT8],
    # An int16 add of two int8 matmuls, read by an int8 matmul.
    "int16-add": [R(".*", op="add", act_qtype="int16"), INT8],
}
# How b runs: the start of its kernel, what it reads, and a word of why it is emulated.
EXPECTED = {
    "int8-into-int16": ("float32 op on dequantized int8 weight", "reads a/tanh as int16, converted from int8",
                        "int16"),
    "int16-into-int8": ("int8 x int8 -> int32", "reads a/tanh as int8, converted from int16", None),
    "float-into-int8": ("int8 x int8 -> int32", "reads a/tanh as int8, converted from float", None),
    "int16-add": ("int8 x int8 -> int32", "reads a/add as int8, converted from int16", None),
}
CASES = [pytest.param(model, rules, id=f"{model}-{rules}")
         for model in ("dense", "conv") for rules in ("int8-into-int16", "int16-into-int8", "float-into-int8")]
CASES.append(pytest.param("residual", "int16-add", id="residual-int16-add"))


@functools.cache
def _setup(model_name, rules_name, target="both"):
    cls, x = MODELS[model_name]
    model = cls()
    variables = model.init(jax.random.PRNGKey(0), x[:1])
    plan = odmlq.plan(model, RULES[rules_name], x[:1], variables=variables, target=target)
    calibration = odmlq.calibrate(model, plan, [x[i:i + 16] for i in range(0, len(x), 16)], variables=variables)
    return model, variables, x, plan, calibration


def _max_lsb(got, want, ts) -> float:
    """The largest difference, in steps of the edge's scale (as tests/xla/test_ptq.py)."""
    return float(np.max(np.abs(np.asarray(got) - np.asarray(want)) / np.asarray(ts.scale)))


def _equal_share(a, b) -> float:
    return float(np.mean(np.asarray(a) == np.asarray(b)))


@pytest.mark.parametrize("target", ["xla", "both"])
@pytest.mark.parametrize("model_name,rules_name", CASES)
def test_every_static_edge_matches_simulate_within_one_lsb(model_name, rules_name, target):
    model, variables, x, plan, calibration = _setup(model_name, rules_name, target)
    assert plan.conversions, "the rules make no conversion"
    qmodel = odmlq.ptq(model, plan, variables, calibration)
    y, edges = jax.jit(lambda p, x: qmodel.apply(p, x, capture=True))(qmodel.params, x)
    scales = compute_scales(plan, calibration, variables)
    y_sim, edges_sim = odmlq.simulate(model, plan, scales, x, variables=variables, capture=True)
    assert set(scales.edges) >= set(plan.graph.outputs)
    for edge_id, ts in scales.edges.items():
        assert _max_lsb(edges[edge_id], edges_sim[edge_id], ts) <= 1.0 + 1e-3, edge_id
    assert _equal_share(y, y_sim) >= 0.99

    kernel, reads, emulated = EXPECTED[rules_name]
    low = qmodel.lowerings[f"b/{'conv' if model_name == 'conv' else 'dot_general'}"]
    assert low.kernel.startswith(kernel) and reads in low.kernel, low
    assert low.emulated is None if emulated is None else emulated in low.emulated, low
    assert low.schema == "static"


@pytest.mark.parametrize("model_name,rules_name", CASES)
def test_the_op_reads_the_converted_input(model_name, rules_name):
    """ptq equals simulate, and simulate reading each edge at its own scale
    (conversions dropped) does not: the conversion is what the op reads."""
    model, variables, x, plan, calibration = _setup(model_name, rules_name)
    y = odmlq.ptq(model, plan, variables, calibration)(x)
    scales = compute_scales(plan, calibration, variables)
    y_sim = odmlq.simulate(model, plan, scales, x, variables=variables)
    unconverted = odmlq.simulate(model, plan, dataclasses.replace(scales, conversions={}), x, variables=variables)
    assert _equal_share(y, y_sim) >= 0.99
    assert _equal_share(y, unconverted) <= 0.95


@pytest.mark.parametrize("rules_name", ["int8-into-int16", "int16-into-int8", "float-into-int8"])
def test_xla_agrees_with_the_litert_export(rules_name):
    """The same plan through LiteRT (a QUANTIZE per conversion): both within
    1 LSB of simulate, so within 1 LSB of each other (seen: 0)."""
    model, variables, x, plan, calibration = _setup("dense", rules_name)
    batches = [x[i:i + 16] for i in range(0, len(x), 16)]
    # A skipped op stays in float on LiteRT too, which export_tflite warns about.
    expected = pytest.warns(UserWarning, match="float") if plan.float_ops else contextlib.nullcontext()
    with expected:
        export = odmlq.export_tflite(model, plan, batches, variables=variables, calibration=calibration,
                                     verify=False, allow_float_ops=bool(plan.float_ops))
    qmodel = odmlq.ptq(model, plan, variables, calibration)
    y_litert, y_xla = litert_rows(export.tflite, x), np.asarray(qmodel(x))
    lsb = float(np.asarray(qmodel.scales.edges[plan.graph.outputs[0]].scale).reshape(-1)[0])
    assert np.max(np.abs(y_litert - y_xla)) <= lsb * (1 + 1e-4)


def test_scales_without_the_conversions_are_refused():
    model, variables, x, plan, calibration = _setup("dense", "int8-into-int16")
    qmodel = odmlq.ptq(model, plan, variables, calibration)
    with pytest.raises(PlanError, match=r"no conversion scale for edge 'a/tanh' read as int16 by b/dot_general "
                                        r"\(1 of the plan's 1 conversions missing\); .*odmlq.compute_scales"):
        QuantizedModel(model, plan, qmodel.params, dataclasses.replace(qmodel.scales, conversions={}))


def test_a_static_input_without_a_scale_is_refused():
    model, variables, x, plan, calibration = _setup("dense", "int8-into-int16")
    qmodel = odmlq.ptq(model, plan, variables, calibration)
    edges = {k: v for k, v in qmodel.scales.edges.items() if k != "input_0"}
    with pytest.raises(PlanError, match=r"Op 'a/dot_general' reads static edge 'input_0' \(int8 .*\) but the "
                                        r"scales have none for it; .*odmlq.compute_scales"):
        QuantizedModel(model, plan, qmodel.params, dataclasses.replace(qmodel.scales, edges=edges))
