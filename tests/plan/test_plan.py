import json
import warnings

import jax.numpy as jnp
import pytest
from hypothesis import given, settings, strategies as st

import odmlq
from odmlq import GranularityError, PerBlock, PerChannel, PerTensor, Plan, Rule, plan
from odmlq.calibration import AbsMax, MinMax, MSE, Percentile
from odmlq.plan import plan_graph
from samples.models import SAMPLES

INT8 = [Rule(".*", weight_qtype="int8", act_qtype="int8")]


def _plan(name, rules=INT8):
    model, inputs, variables = SAMPLES[name]()
    return plan(model, rules, *inputs, variables=variables)


def test_cnn_plan_lists_per_channel_weights_and_every_edge():
    p = _plan("cnn")
    text = str(p)
    for op_id, param, axis in [("conv1/conv", "conv1/kernel", 3), ("conv2/conv", "conv2/kernel", 3),
                               ("dense1/dot_general", "dense1/kernel", 1),
                               ("head/dot_general", "head/kernel", 1)]:
        weight = p.ops[op_id].weights[0]
        assert weight.param == param
        assert weight.spec.qtype == "int8" and weight.spec.scale_axes == (axis,)
        assert weight.spec.narrow_range and weight.spec.symmetric
        assert f"{param}: int8 per-channel[{axis}] sym narrow absmax" in text
        assert p.ops[op_id].weights[1].spec is None  # bias: derived int32
    fused = {"conv1/conv", "conv2/conv", "dense1/dot_general"}  # relu follows each
    for edge_id in fused:
        assert p.edges[edge_id].spec is None
        assert p.edges[edge_id].reason == f"fused into {edge_id.split('/')[0]}/relu"
    for edge_id, edge in p.edges.items():
        if edge_id in fused:
            continue
        assert edge.spec is not None, edge_id
        assert edge.spec.qtype == "int8" and not edge.spec.symmetric
        assert edge_id in text
    assert p.edges["input_0"].reason == "first consumer conv1/conv"


@pytest.mark.parametrize("pair", [("cnn", "cnn_nnx"), ("mlp", "mlp_nnx")], ids=lambda p: "-".join(p))
def test_linen_and_nnx_plans_are_identical(pair):
    linen, nnx = (_plan(n) for n in pair)
    assert linen.ops == nnx.ops
    assert linen.edges == nnx.edges
    assert linen.graph.ops == nnx.graph.ops
    # The printed tables are identical below the header line.
    assert str(linen).split("\n", 1)[1] == str(nnx).split("\n", 1)[1]


def test_unmatched_rule_warns_with_index_and_pattern():
    rules = [Rule("encoder/.*", weight_qtype="int4"), *INT8]
    with pytest.warns(odmlq.UnmatchedRuleWarning, match=r"rules\[0\] \(module_path='encoder/\.\*'\) matched no op"):
        p = _plan("mlp", rules)
    assert p.unmatched_rules == (0,)
    assert "Rules that matched nothing: rules[0] 'encoder/.*'" in str(p)


def test_unmatched_ops_are_float_and_listed():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = _plan("cnn", [Rule("conv.*", weight_qtype="int8", act_qtype="int8")])
    assert "head/dot_general" in p.float_ops and "conv1/conv" not in p.float_ops
    assert p.ops["head/dot_general"].weights[0].spec is None
    assert p.edges["head/dot_general"].spec is None
    assert p.edges["head/dot_general"].reason == "no rule (producer)"
    assert "Float ops" in str(p)


def test_skip_rule_keeps_head_in_float():
    p = _plan("cnn", [Rule("head", skip=True), *INT8])
    assert p.ops["head/dot_general"].rule == 0
    assert p.ops["head/dot_general"].weights[0].spec is None
    assert p.edges["head/dot_general"].spec is None
    assert p.edges["dense1/relu"].spec is not None


def test_block_size_must_divide_the_contraction_axis():
    rules = [Rule(".*", weight_qtype="int4", weight_granularity=PerBlock(5))]
    with pytest.raises(GranularityError, match=r"op 'dense1/dot_general' \(rules\[0\]\), weight 'dense1/kernel' of shape \(64, 512\): block size 5 does not divide axis 0 of size 64; choose a divisor such as \[8, 16, 32, 64\], or give this module a rule of its own before this one \(e.g. Rule\('dense1', weight_qtype='int4', weight_granularity=PerChannel\(\)\)\)"):
        _plan("mlp", rules)


def test_block_plan():
    p = _plan("mlp", [Rule(".*", weight_qtype="int4", weight_granularity=PerBlock(16))])
    spec = p.ops["dense1/dot_general"].weights[0].spec
    assert (spec.block_axis, spec.block_size, spec.scale_axes) == (0, 16, (1,))


def test_emulated_qtype_is_said_in_the_plan():
    p = _plan("mlp", [Rule(".*", weight_qtype="nf4", weight_granularity=PerBlock(16))])
    assert "(emulated on xla/litert)" in str(p)


def test_scan_stacked_weights_get_a_scale_per_layer():
    from tests.graph.test_graph import _Scanned

    model, x = _Scanned(), jnp.ones((2, 8))
    p = plan(model, INT8, x)  # abstract variables: shapes are enough to plan
    fc = next(o for o in p.graph.ops if o.id == "layers/fc/dot_general")
    assert p.ops[fc.id].weights[0].spec.scale_axes == (0, 2)  # layer axis + output channels
    # The carry the layers rewrite is an edge of its own (every step's input), not the start's alias.
    assert p.graph.edges["layers/scan:in_0"].alias is None
    assert p.edges["layers/scan:in_0"].reason == "first consumer layers/fc/dot_general"


_rule_strategy = st.builds(
    lambda path, wq, aq, gran, cal, sym: Rule(path, skip=True) if wq is None and aq is None else
    Rule(path, weight_qtype=wq, act_qtype=aq, weight_granularity=gran if wq else None,
         act_calibration=cal if aq else None, act_symmetric=sym if aq else None),
    st.sampled_from([".*", "dense.*", "head", "conv.*"]),
    st.sampled_from(["int8", "int4", "fp8_e4m3", None]),
    st.sampled_from(["int8", "int16", None]),
    st.sampled_from([PerTensor(), PerChannel(), PerChannel(0)]),
    st.sampled_from([MinMax(), Percentile(99.9), MSE(), AbsMax(clip_ratio=0.9)]),
    st.sampled_from([True, False, None]),
)


@settings(max_examples=30, deadline=None)
@given(st.lists(_rule_strategy, min_size=1, max_size=3))
def test_plan_json_round_trip(rules):
    graph = _GRAPH
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = plan_graph(graph, rules)
    again = Plan.from_json(p.to_json())
    assert again == p
    assert str(again) == str(p)


_model, _inputs, _variables = SAMPLES["cnn"]()
_GRAPH = odmlq.trace(_model, *_inputs, variables=_variables)


def test_plan_json_is_refused_when_foreign():
    with pytest.raises(odmlq.PlanError, match="Not an odmlq plan"):
        Plan.from_json(json.dumps({"x": 1}))
    p = json.loads(_plan("mlp").to_json())
    p["version"] = 99
    with pytest.raises(odmlq.PlanError, match="version 99 is not supported"):
        Plan.from_json(json.dumps(p))


def _scaled(params, x):
    return jnp.maximum(x @ params["w"] * 0.3 + jnp.array([0.5, -1.0, 2.0], jnp.float32), 0.25)


def test_constant_operands_of_elementwise_ops_are_quantized_like_activations():
    params = {"w": jnp.ones((4, 3))}
    p = plan(_scaled, INT8, jnp.ones((2, 4)), variables=params)
    specs = {op.kind: p.ops[op.id].constants for op in p.graph.ops}
    assert specs["dot_general"] == ()
    for kind in ("mul", "add", "max"):
        (spec,) = specs[kind]
        assert spec.qtype == "int8" and spec.symmetric and spec.scale_axes == ()
    assert "constant 0: int8 per-tensor sym (scale from its value)" in str(p)
    skipped = plan(_scaled, [Rule(".*", op="mul", skip=True), *INT8], jnp.ones((2, 4)), variables=params)
    assert skipped.ops["mul"].constants == (None,)
    again = Plan.from_json(p.to_json())  # constant values survive the round trip
    assert again == p and str(again) == str(p)
    add = again.graph.op("add")
    assert add.constants[0].value.tolist() == [[0.5, -1.0, 2.0]]
