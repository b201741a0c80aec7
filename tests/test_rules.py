import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import odmlq
from odmlq import PerBlock, PerChannel, PerTensor, Rule, RuleError, load_rules
from odmlq.calibration import MinMax, Percentile


def test_short_form_and_defaults():
    r = Rule(".*", weight_qtype="int8", act_qtype="int8")
    assert r.resolved("weight_granularity") == PerChannel()
    assert r.resolved("weight_symmetric") is True
    assert r.resolved("act_granularity") == PerTensor()
    assert r.resolved("act_symmetric") is False  # int8 activations: zero point
    assert r.resolved("act_calibration") == MinMax(headroom=True)
    assert r.resolved("weight_algorithm") == odmlq.GPTQ(required=False)
    assert Rule(".*", act_qtype="int16").resolved("act_symmetric") is True  # 16x8 needs zp 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param(dict(module_path="conv(", weight_qtype="int8"), r"not a valid regex.*re\.escape", id="bad-regex"),
        pytest.param(dict(module_path=".*", weight_qtype="int9"), r"weight_qtype.*Unknown qtype 'int9'.*choose one of", id="unknown-qtype"),
        pytest.param(dict(module_path=".*", act_qtype="bogus"), r"act_qtype.*Unknown qtype", id="unknown-act-qtype"),
        pytest.param(dict(module_path=".*", skip=True, weight_qtype="int8"), r"skip=True.*also sets \['weight_qtype'\]", id="skip-and-qtype"),
        pytest.param(dict(module_path=".*"), r"quantizes nothing", id="empty"),
        pytest.param(dict(module_path=".*", act_qtype="int8", weight_granularity=PerTensor()), r"weight_granularity.*no weight_qtype", id="weight-field-without-qtype"),
        pytest.param(dict(module_path=".*", act_qtype="int8", act_dynamic=True, act_calibration=MinMax()), r"act_dynamic=True.*act_calibration", id="dynamic-and-calibration"),
        pytest.param(dict(module_path=".*", weight_qtype="fp8_e4m3", weight_symmetric=False), r"no zero point", id="asym-fp8"),
        pytest.param(dict(module_path=".*", act_qtype="int8", act_granularity=PerBlock(32)), r"PerBlock is for weights", id="act-blocks"),
        pytest.param(dict(module_path=".*", act_qtype="nf4"), r"weight-only format", id="nf4-activations"),
        pytest.param(dict(module_path=".*", act_dynamic=True), r"act_dynamic.*no act_qtype", id="dynamic-without-qtype"),
        pytest.param(dict(module_path=".*", weight_qtype="int8", weight_calibration="nope"), r"weight_calibration", id="bad-calibration"),
    ],
)
def test_bad_rules(kwargs, match):
    with pytest.raises(RuleError, match=match):
        Rule(**kwargs)


def test_rule_error_is_a_value_error():
    with pytest.raises(ValueError):
        Rule(".*")


def test_block_size_must_be_positive():
    with pytest.raises(odmlq.GranularityError, match=r"PerBlock\(size=0\)"):
        PerBlock(0)


def test_op_filter():
    r = Rule("dense.*", op=("dot_general", "einsum"), weight_qtype="int8")
    assert r.matches("dense1", "dot_general")
    assert not r.matches("dense1", "relu")
    assert not r.matches("xdense1", "dot_general")  # full match, not search


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "a/b", "c/d/e", ""]), min_size=1, max_size=4),
       st.sampled_from(["a", "b", "a/b", "c/d/e", "", "x"]))
def test_first_match_wins(patterns, path):
    """The plan's rule for an op is the first whose regex full-matches its path."""
    from odmlq.plan import check_rules

    rules = check_rules([Rule(re.escape(p), weight_qtype="int8") for p in patterns])
    chosen = next((i for i, r in enumerate(rules) if r.matches(path, "dot_general")), None)
    expected = patterns.index(path) if path in patterns else None
    assert chosen == expected


def test_to_dict_round_trip():
    r = Rule("enc/.*", op="dot_general", weight_qtype="int4", weight_granularity=PerBlock(32),
             act_qtype="int8", act_calibration=Percentile(99.9))
    again = Rule.from_dict(json.loads(json.dumps(r.to_dict())))
    assert again == r
    head = Rule(".*", writes_output=True, weight_qtype="int8", act_qtype="int16")
    assert head.to_dict()["writes_output"] is True and "writes_output" not in r.to_dict()
    assert Rule.from_dict(json.loads(json.dumps(head.to_dict()))) == head


class _Head(nn.Module):
    """Two dense layers; the second's output reaches the model output through a
    reshape and a transpose (ops that only move values)."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16, name="body")(x))
        y = nn.Dense(12, name="head")(h).reshape(x.shape[0], 3, 4)
        return jnp.transpose(y, (0, 2, 1)), h


def test_writes_output_matches_the_ops_that_write_an_output_through_layout_ops():
    """The output op is the head's matmul, through the reshape and transpose
    after it; the body also writes an output (h), directly: its ReLU is matched,
    its matmul (read only by the ReLU and the head) is not."""
    model = _Head()
    x = np.ones((2, 8), np.float32)
    variables = model.init(jax.random.PRNGKey(0), x)
    rules = [Rule(".*", writes_output=True, weight_qtype="int8", act_qtype="int16"),
             Rule(".*", weight_qtype="int8", act_qtype="int8")]
    plan = odmlq.plan(model, rules, x, variables=variables)
    first = {op_id for op_id, op in plan.ops.items() if op.rule == 0}
    kinds = {plan.graph.op(o).kind for o in first}
    assert {"dot_general", "reshape", "transpose", "relu"} <= kinds, first
    assert any(o.startswith("head/") for o in first) and "body/relu" in first
    assert not any(o.startswith("body/dot_general") for o in first), first
    assert not Rule(".*", writes_output=True, act_qtype="int16").matches("head", "dot_general")


def test_load_yaml_and_json(tmp_path):
    y = tmp_path / "rules.yaml"
    y.write_text(
        "rules:\n"
        "  - {module_path: head, skip: true}\n"
        "  - module_path: '.*'\n"
        "    weight_qtype: int8\n"
        "    weight_granularity: {kind: per_block, size: 16}\n"
        "    act_qtype: int8\n"
        "    act_calibration: {method: percentile, percentile: 99.9}\n"
    )
    rules = load_rules(y)
    assert rules[0] == Rule("head", skip=True)
    assert rules[1].weight_granularity == PerBlock(16)
    assert rules[1].act_calibration == Percentile(99.9)
    j = tmp_path / "rules.json"
    j.write_text(json.dumps([r.to_dict() for r in rules]))
    assert load_rules(j) == rules


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("rules:\n  - module_path: '.*'\n    weight_qtype: [int8\n")
    with pytest.raises(RuleError, match=re.escape(str(f)) + r":\d+: YAML syntax error"):
        load_rules(f)


def test_json_syntax_error_names_file_and_line(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text('[\n {"module_path": ".*",\n  "weight_qtype": }\n]')
    with pytest.raises(RuleError, match=re.escape(str(f)) + r":3: JSON syntax error"):
        load_rules(f)


def test_rules_file_bad_rule_names_index_and_field(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("- {module_path: '.*', weight_qtype: int8}\n- {module_path: '.*', wieght_qtype: int8}\n")
    with pytest.raises(RuleError, match=r"rule 1: Unknown rule field\(s\) \['wieght_qtype'\]"):
        load_rules(f)


def test_missing_rules_file():
    with pytest.raises(RuleError, match=r"Cannot read rules file 'nope\.yaml'"):
        load_rules("nope.yaml")


@pytest.mark.parametrize("value", ["yes please", "yes", "on", "y", "1"])
def test_yaml_booleans_are_only_true_and_false(tmp_path, value):
    # YAML 1.1 reads yes/on/y as true; a rules file accepts only true/false,
    # so a typo'd or prose value is refused by field name, never read as true.
    f = tmp_path / "r.yaml"
    f.write_text(f"- {{module_path: '.*', act_qtype: int8, act_dynamic: {value}}}\n")
    with pytest.raises(RuleError, match=r"rule 0: Rule\('\.\*'\): act_dynamic=.* must be true or false"):
        load_rules(f)


def test_yaml_true_false_and_words_that_look_boolean(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("- {module_path: on, skip: True}\n- {module_path: '.*', act_qtype: int8, act_dynamic: false}\n")
    rules = load_rules(f)
    assert rules == [Rule("on", skip=True), Rule(".*", act_qtype="int8")]


@pytest.mark.parametrize("field", ["weight_symmetric", "act_symmetric", "act_dynamic", "skip", "writes_output"])
def test_boolean_fields_refuse_other_values(field):
    fields = {"weight_qtype": "int8", "act_qtype": "int8", field: "false"}
    with pytest.raises(RuleError, match=f"{field}='false' must be true or false"):
        Rule(".*", **fields)


@pytest.mark.parametrize("kwargs,match", [
    (dict(weight_qtype="int8", weight_calibration="mse"), r"weight_calibration=MSE\(\).*PerChannel.*PerTensor\(\)"),
    (dict(act_qtype="int8", act_calibration=odmlq.Percentile(99.9), act_granularity=odmlq.PerChannel(-1)),
     r"act_calibration=Percentile.*histogram.*act_granularity=PerTensor\(\)"),
], ids=["weights-per-channel", "activations-per-channel"])
def test_a_histogram_method_per_channel_is_refused_by_the_rule(kwargs, match):
    with pytest.raises(odmlq.RuleError, match=match):
        odmlq.Rule("encoder/.*", **kwargs)
