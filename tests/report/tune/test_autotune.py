"""autotune: rules that meet an accuracy floor or a size budget, measured.

The model below has one group whose int8 error an exp magnifies (`a`) and
groups that int8 serves well (`b`, `c`): an accuracy floor that all-int8
misses must be met by raising `a` alone. The digits CNN checks a size budget
(3 bits per weight on XLA) against its accuracy.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq
from odmlq.errors import RuleError
from tests.report.test_report import trained_cnn


class _OneSensitive(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32, name="b")(x))
        a = nn.Dense(8, name="a")(h)
        c = nn.Dense(8, name="c")(h)
        return jnp.exp(2.0 * jnp.tanh(a)) + c


@pytest.fixture(scope="module")
def sensitive():
    model = _OneSensitive()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, 16)).astype(np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    batches = [x[i:i + 32] for i in range(0, 128, 32)]
    int8 = odmlq.autotune(model, variables, batches, target=odmlq.TuneTarget(min_sqnr_db=0.0), check=False)
    return model, variables, batches, int8


def test_an_easy_floor_keeps_everything_int8(sensitive):
    *_, int8 = sensitive
    assert int8.met and len(int8.trials) == 1
    assert set(int8.choices.values()) == {"int8"}
    assert [r.to_dict() for r in int8.rules] == [{"module_path": ".*", "weight_qtype": "int8", "act_qtype": "int8"}]


def test_a_floor_int8_misses_is_met_by_raising_the_sensitive_group(sensitive, tmp_path):
    model, variables, batches, int8 = sensitive
    floor = int8.measured.sqnr_db + 6.0
    result = odmlq.autotune(model, variables, batches, target=odmlq.TuneTarget(min_sqnr_db=floor), backend="xla")
    assert result.met, str(result)
    assert result.measured.sqnr_db >= floor
    # c's error reaches the outputs unmagnified: it stays int8; a (and b,
    # whose output a reads) rise.
    assert result.choices["c"] == "int8" and result.choices["a"] != "int8", str(result)
    assert result.checks["xla"].startswith("ran quantized")
    # The saved rules are ordinary rules: loaded back, they plan and measure the same.
    path = result.save_rules(tmp_path / "rules.yaml")
    rules = odmlq.load_rules(path)
    assert [r.to_dict() for r in rules] == [r.to_dict() for r in result.rules]
    plan = odmlq.plan(model, rules, batches[0], variables=variables, target="xla")
    calibration = odmlq.calibrate(model, plan, batches, variables=variables)
    x = np.concatenate(batches)
    outputs = odmlq.simulate(model, plan, calibration, x, variables=variables)
    reference = model.apply(variables, x)
    sqnr = 10 * np.log10(float(jnp.sum(reference ** 2)) / float(jnp.sum((outputs - reference) ** 2)))
    # The same rules and data give the same statistics: equal within float32 rounding.
    np.testing.assert_allclose(sqnr, result.measured.sqnr_db, atol=0.01)


def test_on_litert_groups_are_joined_where_the_converter_cannot_convert(sensitive):
    """An int16 op reading an int8 relu's output would need the converter to
    requantize inside the relu (refused or wrong): LiteRT's plan check names
    both ops, and autotune gives them one candidate. The rules then export,
    verify op by op, and run on XLA unedited."""
    model, variables, batches, int8 = sensitive
    floor = int8.measured.sqnr_db + 6.0
    result = odmlq.autotune(model, variables, batches, target=odmlq.TuneTarget(min_sqnr_db=floor), backend="both")
    assert result.met, str(result)
    assert result.checks["litert"].startswith("exported") and "verified op by op" in result.checks["litert"]
    assert result.checks["xla"].startswith("ran quantized")
    plan = odmlq.plan(model, result.rules, batches[0], variables=variables)
    odmlq.litert.check_plan(plan, allow_float_ops=True)  # no conflict left


def test_the_prediction_follows_the_measurement(sensitive):
    """Noise from several groups adds up: each trial's predicted SQNR is within
    1 dB of what it measured (independent rounding; correlated errors and
    ranges moved by neighbours are what remains)."""
    model, variables, batches, int8 = sensitive
    result = odmlq.autotune(model, variables, batches, check=False,
                            target=odmlq.TuneTarget(min_sqnr_db=int8.measured.sqnr_db + 3.0))
    for trial in (*int8.trials, *result.trials):
        assert abs(trial.predicted_sqnr_db - trial.measured.sqnr_db) < 1.0, str(result)
    # Alone, the sensitive group costs the outputs the most.
    alone = {path: table["int8"] for path, table in result.sensitivity.items()}
    assert min(alone, key=alone.get) == "a" or min(alone, key=alone.get) == "", alone


def test_a_size_budget_on_the_digits_cnn_keeps_its_accuracy():
    digits, model, variables, *_ = trained_cnn()
    calibration = [digits.x_calibration[i:i + 32] for i in range(0, len(digits.x_calibration), 32)]

    def accuracy(apply):
        return float(np.mean(np.argmax(np.asarray(apply(digits.x_test)), -1) == digits.y_test))

    result = odmlq.autotune(model, variables, calibration, backend="xla", eval_fn=accuracy,
                            target=odmlq.TuneTarget(max_bits_per_weight=3.0, max_metric_drop=0.01))
    assert result.measured.bits_per_weight <= 3.0, str(result)
    assert result.met, str(result)  # within 1 point of float (measured on 540 test images)
    assert result.float_metric - result.measured.metric <= 0.01
    assert "w2" in result.choices.values()  # 3 bits on average needs some int2
    assert result.checks["xla"].startswith("ran quantized")


def test_an_unreachable_floor_is_reported_not_met(sensitive):
    model, variables, batches, _ = sensitive
    result = odmlq.autotune(model, variables, batches, candidates=["int8"], check=False,
                            target=odmlq.TuneTarget(min_sqnr_db=200.0))
    assert not result.met and result.misses and "SQNR" in result.misses[0]
    assert "NOT met" in str(result)


@pytest.mark.parametrize("kwargs, match", [
    ({"target": None}, "odmlq.TuneTarget"),
    ({"target": odmlq.TuneTarget(max_metric_drop=0.01)}, "eval_fn"),
    ({"target": odmlq.TuneTarget(min_cosine=0.99), "backend": "tpu"}, "backend='tpu'"),
    ({"target": odmlq.TuneTarget(min_cosine=0.99), "candidates": ["int3"]}, "Unknown candidate 'int3'"),
    ({"target": odmlq.TuneTarget(min_cosine=0.99), "max_trials": 0}, "max_trials"),
    ({"target": odmlq.TuneTarget(min_cosine=0.99), "candidates": ["int8", "int8"]}, "must differ"),
])
def test_bad_arguments_are_named_before_any_work(sensitive, kwargs, match):
    model, variables, batches, _ = sensitive
    with pytest.raises(RuleError, match=match):
        odmlq.autotune(model, variables, batches, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({}, "needs a floor or a budget"),
    ({"min_cosine": 1.5}, r"\[-1, 1\]"),
    ({"max_bytes": -1}, "must not be negative"),
    ({"min_sqnr_db": float("nan")}, "finite"),
    ({"max_latency_ratio": 0.0}, "must be positive"),
])
def test_bad_targets_are_named(kwargs, match):
    with pytest.raises(RuleError, match=match):
        odmlq.TuneTarget(**kwargs)


def test_candidates_are_rules_without_a_path():
    candidate = odmlq.Candidate("w4b32", weight_qtype="int4", weight_granularity=odmlq.PerBlock(32))
    assert candidate.rule("dense").weight_granularity == odmlq.PerBlock(32)
    assert candidate.weight_bits == 4.0 and candidate.act_bits == 32.0
    with pytest.raises(RuleError, match="module_path and op are chosen by autotune"):
        odmlq.Candidate("x", module_path="a", weight_qtype="int8")
    with pytest.raises(RuleError, match="Candidate 'y'"):
        odmlq.Candidate("y", weight_qtype="int9")


class _AddThenLog(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16, name="inner")(x)
        return jnp.log(jnp.abs(x + h) + 1.0)


class _Residual(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, name="up")(x)
        return nn.Dense(4, name="head")(_AddThenLog(name="block")(x))


def test_a_module_whose_ops_litert_runs_differently_is_split_by_op_kind():
    """LiteRT runs the residual ADD in int16 and LOG only in int8: the
    module holding both is split by op kind, so int16 is offered to its ADD
    without its LOG (one group of both would be refused int16 whole).
    The rules name the op kinds, and export and verify unedited."""
    model = _Residual()
    x = np.random.default_rng(1).standard_normal((64, 16)).astype(np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    batches = [x[i:i + 16] for i in range(0, 64, 16)]
    result = odmlq.autotune(model, variables, batches, target=odmlq.TuneTarget(min_sqnr_db=60.0))
    assert "block [add]" in result.sensitivity and "block [log]" in result.sensitivity, str(result)
    assert "block" not in result.sensitivity
    assert "int16x8" in result.sensitivity["block [add]"]
    assert "int16x8" not in result.sensitivity["block [log]"]
    assert result.checks["litert"].startswith("exported") and "verified op by op" in result.checks["litert"], \
        str(result)
    assert all(r.op is None or set(r.op) <= {"add", "abs", "log"} for r in result.rules)


def test_candidates_calibrated_with_different_methods_share_one_tuning(sensitive):
    """int8 ranges by MSE (a histogram) and int16's by MinMax(headroom=True)
    (the extremes) need different statistics of the same edges: each plan
    gets the ones its methods read, observed once."""
    model, variables, batches, int8 = sensitive
    candidates = [odmlq.Candidate("int8", weight_qtype="int8", act_qtype="int8", act_calibration=odmlq.MSE()),
                  "int16x8", "float"]
    result = odmlq.autotune(model, variables, batches, candidates=candidates,
                            target=odmlq.TuneTarget(min_sqnr_db=int8.measured.sqnr_db + 6.0))
    assert result.met, str(result)
    # Both precisions were measured on every group, each with its own ranges.
    assert all({"int8", "int16x8"} <= set(s) for s in result.sensitivity.values()), str(result)
    assert "verified op by op" in result.checks["litert"], str(result)


def test_a_converter_refusal_is_traced_to_one_group_by_bisection():
    """The converter refuses configurations where groups 3 and 7 are both
    quantized: the bisection names 7 (with it and the groups after it in
    float the model converts), and with 7 in float the configuration converts."""
    from odmlq.report.tune._converts import refused_group

    float_index = 2
    calls = []

    def converts(config):
        calls.append(config.copy())
        return not (config[3] != float_index and config[7] != float_index)

    config = np.array([0, 1, 0, 0, 2, 1, 0, 0, 1, 0])
    assert not converts(config)
    culprit = refused_group(config, float_index, lambda c: None, converts)
    assert culprit == 7
    config[culprit] = float_index
    assert converts(config)
    assert len(calls) <= 2 + int(np.ceil(np.log2(9)))  # a bisection, not one conversion per group


def test_a_latency_budget_keeps_quantized_only_the_groups_xnnpack_runs(sensitive):
    """Without a latency budget the floor is met with int16x8 matmuls, which
    XNNPACK does not run (they fall to LiteRT's reference kernels). With
    one, no group is offered a candidate XNNPACK leaves any of its ops at
    (int16x8 anywhere; int8 for `a`, whose int8 EXP it has no kernel for):
    the chosen rules export with every op on XNNPACK in one partition, still
    meet the floor, and the latency is measured against float's. (The
    budget is loose, 5x float: what is asserted is the placement, not a
    timing of a model this small.)"""
    model, variables, batches, int8 = sensitive
    floor = int8.measured.sqnr_db + 6.0
    free = odmlq.autotune(model, variables, batches, target=odmlq.TuneTarget(min_sqnr_db=floor), check=False)
    plain = odmlq.export_tflite(model, free.rules, batches, variables=variables, verify=False,
                                allow_float_ops=True)
    assert plain.delegation.outside, str(free)  # what the budget changes

    result = odmlq.autotune(model, variables, batches,
                            target=odmlq.TuneTarget(min_sqnr_db=floor, max_latency_ratio=5.0))
    assert result.met and result.measured.sqnr_db >= floor, str(result)
    assert "int16x8" not in result.choices.values() and result.choices["a"] == "float", str(result)
    assert result.measured.latency_ms > 0 and result.measured.latency_ratio > 0
    assert "vs float" in str(result) and any("XNNPACK does not run it" in n for n in result.notes)
    gated = odmlq.export_tflite(model, result.rules, batches, variables=variables, allow_float_ops=True)
    assert not gated.delegation.outside and gated.delegation.partitions == 1, str(gated.delegation)
    assert gated.verification.passed


def test_a_missed_latency_budget_tries_each_group_in_float_then_stops(sensitive):
    """A budget no model meets (1 ns) is reported as missed, with the
    measured latency. After the first configuration that holds the floor,
    upgrading could only make it slower: the search tries each quantized
    group alone in float instead (a float op may be the faster one on the
    host), once each, and stops when none is faster or the trials run out.
    Every trial still holds the accuracy floor."""
    model, variables, batches, _ = sensitive
    target = odmlq.TuneTarget(min_sqnr_db=0.0, max_latency_ms=1e-6)
    result = odmlq.autotune(model, variables, batches, backend="xla", check=False, target=target)
    assert not result.met, str(result)
    assert result.misses == tuple(result.measured.latency_misses(result.target))
    assert result.misses[0].startswith("latency ") and result.measured.latency_ms > 1e-6
    first, *floated = result.trials
    assert set(first.counts) == {"int8"} and len(floated) >= 3, str(result)  # a, b and c each in float
    assert [t.counts.get("float") for t in floated[:3]] == [1, 1, 1], str(result)
    assert all(t.misses == tuple(t.measured.latency_misses(target)) for t in result.trials), str(result)
    # the result is the fastest trial, by its ratio to float timed in the same rounds
    assert result.measured.latency_ratio == min(t.measured.latency_ratio for t in result.trials)

    capped = odmlq.autotune(model, variables, batches, backend="xla", check=False, target=target, max_trials=2)
    assert len(capped.trials) == 2 and not capped.met, str(capped)


class _Attention(nn.Module):
    """Matmuls with weights around ops of the attention module itself (its
    reshapes, einsums, softmax, two concatenations and a float gain): where
    one group is raised to int16x8, LiteRT needs its neighbours to agree (a
    CONCATENATION reads its inputs at its output's scale, so one conversion
    cannot serve two of them)."""

    @nn.compact
    def __call__(self, x):
        q = nn.Dense(16, name="query")(x).reshape(x.shape[0], 4, 4)
        v = nn.Dense(16, name="value")(x).reshape(x.shape[0], 4, 4)
        p = jax.nn.softmax(jnp.einsum("bij,bkj->bik", q, q), axis=-1)
        o = jnp.einsum("bik,bkj->bij", p, v).reshape(x.shape[0], 16)
        s = nn.Dense(16, name="skip")(x)
        o = jnp.concatenate([o, s], axis=-1) + jnp.concatenate([s, o], axis=-1)
        o = o * self.param("gain", nn.initializers.ones, (32,))
        return nn.Dense(8, name="out")(o)


class _WithAttention(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _Attention(name="att")(x)


def test_making_precisions_agree_never_floats_a_groups_weights():
    """Groups raised alone to int16x8 (the rest int8) conflict on LiteRT
    with the attention module's own ops (`att/skip`, read by both int8
    concatenations; the module's own ops, raised between int8 matmuls).
    Making them agree by putting a group in float would remove noise but
    store its weights in float32 (4x the bytes the search chose): the
    agreement found stores no more bits of parameters than the configuration
    asked for. (Before this rule, raising a matmul read by the module's ops
    floated it: 10656 bits instead of 7840.)"""
    from odmlq.report.tune._autotune import _Search, _tables
    from odmlq.report.tune._candidates import parse_candidates
    from odmlq.report.tune._model import TunedModel

    model = _WithAttention()
    x = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    batches = [(x[i:i + 16],) for i in range(0, 64, 16)]
    candidates = parse_candidates(["int8", "int16x8", "float"])
    tuned = TunedModel(model, variables, batches, batches, candidates, "litert", None, batches[0])
    tables = _tables(tuned, False)
    search = _Search(tuned, tables, odmlq.TuneTarget(min_sqnr_db=10.0), None, None, lambda text: None)
    groups = np.arange(len(tuned.groups))
    weighted = [g for g in groups if tables.param_bits[2, g] > tables.param_bits[0, g]]
    assert {tuned.groups[g] for g in weighted} >= {"att/query", "att/value", "att/out"}
    changed = 0
    for g in groups:
        asked = np.zeros(len(groups), int)
        asked[g] = 1
        agreed, _ = search.legalize(asked)
        changed += not np.array_equal(agreed, asked)
        assert tables.param_bits[agreed, groups].sum() <= tables.param_bits[asked, groups].sum(), \
            (tuned.groups[g], [candidates[c].name for c in agreed])
    assert changed >= 2  # the conflicts are there to resolve


def test_the_conversions_the_search_costs_are_the_ones_the_export_holds(sensitive):
    """Between groups of other activation qtypes LiteRT needs a QUANTIZE or
    DEQUANTIZE (also at the model's float input and output), and, where an
    integer edge is converted to another integer qtype, a separator (MAXIMUM)
    before it; the search costs each one (`_search.Boundaries`). For every
    configuration LiteRT takes of this toy, it counts exactly the conversion
    and separator ops the exported .tflite holds, and some of them hold
    separators (the search no longer avoids them)."""
    from odmlq.report.tune._autotune import _Search, _tables
    from odmlq.report.tune._candidates import parse_candidates
    from odmlq.report.tune._model import TunedModel, rules_for

    model, variables, batches, _ = sensitive
    batches = [(b,) for b in batches]
    candidates = parse_candidates(["int8", "int16x8", "float"])
    tuned = TunedModel(model, variables, batches, batches, candidates, "litert", None, batches[0])
    tables = _tables(tuned, False)
    search = _Search(tuned, tables, odmlq.TuneTarget(min_sqnr_db=10.0), None, None, lambda text: None)
    legal = {}
    for asked in np.stack(np.meshgrid(*[np.arange(3)] * len(tuned.groups)), -1).reshape(-1, len(tuned.groups)):
        config, _ = search.legalize(asked)
        legal[config.tobytes()] = config
    assert len(legal) >= 8
    separated = 0
    for config in legal.values():
        export = odmlq.export_tflite(model, rules_for(tuned, config), batches, variables=variables,
                                     allow_float_ops=True, verify=False, benchmark=False)
        ops = [op.name for op in export.summary.ops]
        held = sum(op in ("QUANTIZE", "DEQUANTIZE") for op in ops)
        assert tables.boundaries.conversions(config) == held, ([candidates[c].name for c in config], ops)
        assert tables.boundaries.separators(config) == ops.count("MAXIMUM"), (
            [candidates[c].name for c in config], ops)
        separated += ops.count("MAXIMUM") > 0
    assert separated


def test_a_move_that_removes_conversions_is_preferred_to_one_that_adds_them():
    """Two groups whose upgrade to int16 removes the same noise at the same
    cost of their own: one sits between int8 neighbours (raised, it needs a
    conversion on each side), the other between int16 neighbours (raised, it
    removes two). The search raises the second, though the first comes
    first in op order (where a tie went before conversions were costed)."""
    from odmlq.report.tune import _search

    # Groups: 0 -> 1 -> 2 (int8 around the first candidate), 3 -> 4 -> 5 (int16 around the second).
    domain, bits = np.array([1, 2]), np.array([32.0, 8.0, 16.0])  # candidate 0: int8, 1: int16
    edges = tuple((64.0, p, (p + 1,)) for p in (0, 1, 3, 4))
    boundaries = _search.Boundaries(domain=domain, domain_bits=bits, edges=edges)
    cost = np.array([[100.0] * 6, [200.0] * 6])
    noise = np.zeros((2, 6, 1, 1))
    noise[0, [1, 4]] = 1.0  # groups 1 and 4 are as noisy at int8 as each other, and quiet at int16
    tables = _search.Tables(noise=noise, signal=np.full((1, 1), 100.0), cost=cost, weight_bits=cost,
                            param_bits=cost, legal=np.ones((2, 6), bool), weight_elements=1.0, fixed_bits=0.0,
                            boundaries=boundaries)
    config = np.array([0, 0, 0, 1, 0, 1])
    assert boundaries.conversions(config) == 2
    badness = tables.badness(odmlq.TuneTarget(min_sqnr_db=20.0))
    one_step = _search.upgrade(tables, badness, config, lambda c: badness[c, np.arange(6)].sum() < 0.015)
    assert list(one_step) == [0, 0, 0, 1, 1, 1] and boundaries.conversions(one_step) == 0
