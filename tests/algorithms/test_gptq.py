"""GPTQ: weights rounded against their inputs, the same integers on every backend."""

import itertools

import flax
import jax
import numpy as np
import pytest

import odmlq
from odmlq.algorithms import GPTQ, gptq_round, parse_weight_algorithm
from odmlq.calibration import Calibration, Gram
from odmlq.graph import WeightLayout
from samples.digits import batches, load_digits_splits
from samples.models import SAMPLES


def _sqnr_db(reference, value) -> float:
    return float(10 * np.log10(np.sum(reference ** 2) / np.sum((reference - value) ** 2)))


def _correlated_inputs(rng, rows: int, columns: int, *, seed: int = 7) -> np.ndarray:
    """Inputs whose features are strongly correlated (a fixed random mixing of
    independent sources with decaying energy), as a layer's inputs are."""
    mixing = np.random.default_rng(seed).standard_normal((columns, columns))
    return rng.standard_normal((rows, columns)) @ (mixing * np.geomspace(1, 0.05, columns)[:, None])


def _int4_scales(w: np.ndarray) -> np.ndarray:
    return np.broadcast_to(np.abs(w).max(axis=1, keepdims=True) / 7, w.shape)


def _rtn(w, s):
    return np.clip(np.round(w / s), -7, 7) * s


def test_gptq_lowers_the_layer_output_error_on_unseen_inputs():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 64))
    calibration, held_out = _correlated_inputs(rng, 4096, 64), _correlated_inputs(rng, 4096, 64)
    s = _int4_scales(w)
    q = gptq_round(w, s, None, -7, 7, calibration.T @ calibration, GPTQ(), where="test")
    codes = q / s
    np.testing.assert_allclose(codes, np.round(codes), atol=1e-9)  # on the grid
    assert np.round(codes).min() >= -7 and np.round(codes).max() <= 7
    reference = held_out @ w.T
    gptq, rtn = _sqnr_db(reference, held_out @ q.T), _sqnr_db(reference, held_out @ _rtn(w, s).T)
    # int4 per channel on correlated inputs: GPTQ moves each column's error to
    # the columns its inputs correlate with; measured +6.6 dB, floor +3 dB.
    assert gptq >= rtn + 3.0, (gptq, rtn)


def test_full_shrinkage_rounds_to_nearest():
    rng = np.random.default_rng(1)
    w, x = rng.standard_normal((8, 16)), _correlated_inputs(rng, 64, 16)
    s = _int4_scales(w)
    q = gptq_round(w, s, None, -7, 7, x.T @ x, GPTQ(), shrinkage=1.0, where="test")
    np.testing.assert_array_equal(q, _rtn(w, s))


def test_block_size_changes_nothing_but_speed():
    rng = np.random.default_rng(2)
    w, x = rng.standard_normal((16, 96)), _correlated_inputs(rng, 1024, 96)
    s = _int4_scales(w)
    a = gptq_round(w, s, None, -7, 7, x.T @ x, GPTQ(block_size=1), where="test")
    b = gptq_round(w, s, None, -7, 7, x.T @ x, GPTQ(block_size=32), where="test")
    # Equal in exact arithmetic; float64 sums in another order may flip a
    # near-tie: at most one code in a thousand, by one step.
    assert np.mean(a != b) <= 1e-3 and np.max(np.abs(a - b) / s) <= 1 + 1e-9


def test_shrinkage_grows_as_rows_get_few_for_the_columns():
    rng = np.random.default_rng(3)

    def gram(rows):
        x = _correlated_inputs(rng, rows, 64)
        return Gram((x.T @ x)[None], rows, WeightLayout((1,), (0,)),
                    np.array([np.sum(np.sum(x * x, axis=1) ** 2)]))

    many, few = float(gram(100_000).shrinkage()[0]), float(gram(32).shrinkage()[0])
    assert 0.0 <= many < 0.01 and few > 0.2, (many, few)


@pytest.fixture(scope="module")
def digits():
    return load_digits_splits()


@pytest.fixture(scope="module")
def gptq_cnn(digits):
    model, _, variables = SAMPLES["cnn"]()
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", weight_algorithm=GPTQ())]
    export = odmlq.export_tflite(model, rules, batches(digits.x_calibration, 64), variables=variables)
    return model, variables, export


def test_gptq_export_verifies_and_xla_holds_the_same_integers(gptq_cnn, digits):
    """Every backend reads the rounded weights from the Scales: the LiteRT
    file's int8 kernels equal the XLA model's QArrays (exact), and the outputs
    of 100 images agree within 1 LSB (integer kernels may round a half step
    differently; measured: 0 LSB)."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    model, variables, export = gptq_cnn
    assert export.verification.passed, str(export.verification)
    assert export.scales.weight_values, "no weight was rounded by GPTQ"
    qmodel = odmlq.ptq(model, export.plan, variables, export.calibration)
    # Without XNNPACK, which packs the constant kernels away from get_tensor.
    interpreter = Interpreter(model_content=export.tflite,
                              experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
    interpreter.allocate_tensors()
    int8_constants = [interpreter.get_tensor(t["index"]) for t in interpreter.get_tensor_details()
                      if t["dtype"] == np.int8 and len(t["shape"]) >= 2]
    leaves = {odmlq.graph.param_path(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(
        qmodel.params, is_leaf=lambda x: isinstance(x, odmlq.QArray))[0]}
    for path in export.scales.weight_values:
        ours = np.asarray(leaves[path].values())
        # LiteRT lays kernels out its own way (OHWI, 1HWO for a depthwise conv, (out, in)).
        assert any(c.size == ours.size and np.array_equal(c, np.transpose(ours, perm).reshape(c.shape))
                   for c in int8_constants for perm in itertools.permutations(range(ours.ndim))), path
        rtn = np.asarray(export.scales.weights[path].quantize(odmlq.graph.flat_params(variables)[path]).values())
        assert not np.array_equal(ours, rtn), f"{path}: GPTQ left every code as round-to-nearest"
    x = digits.x_test[:100]
    interpreter = Interpreter(model_content=export.tflite)  # XNNPACK, as the export verified it
    interpreter.allocate_tensors()
    interpreter_out = []
    for image in x:
        interpreter.set_tensor(interpreter.get_input_details()[0]["index"], image[None])
        interpreter.invoke()
        interpreter_out.append(interpreter.get_tensor(interpreter.get_output_details()[0]["index"])[0])
    lsb = float(np.asarray(export.scales.edges[export.plan.graph.outputs[0]].scale).reshape(-1)[0])
    np.testing.assert_allclose(np.stack(interpreter_out), np.asarray(qmodel(x)), rtol=0, atol=lsb * 1.0001)


def test_a_saved_calibration_keeps_the_weights_inputs(gptq_cnn, tmp_path):
    model, variables, export = gptq_cnn
    path = tmp_path / "calibration.npz"
    export.calibration.save(path)
    loaded = Calibration.load(path)
    assert set(loaded.grams) == set(export.calibration.grams) and loaded.grams
    for param, gram in export.calibration.grams.items():
        np.testing.assert_array_equal(loaded.grams[param].matrix, gram.matrix)
        assert loaded.grams[param].rows == gram.rows and loaded.grams[param].layout == gram.layout
    again = odmlq.compute_scales(export.plan, loaded, variables)
    for param, values in export.scales.weight_values.items():
        np.testing.assert_array_equal(again.weight_values[param], values)
    merged = Calibration.from_json(export.calibration.to_json()).merge(loaded)
    for param, gram in export.calibration.grams.items():
        np.testing.assert_allclose(merged.grams[param].matrix, 2 * gram.matrix, rtol=1e-12)


def test_a_plan_keeps_its_weight_algorithm_through_json(gptq_cnn):
    _, _, export = gptq_cnn
    again = odmlq.Plan.from_json(export.plan.to_json())
    specs = again.weight_specs()
    assert specs == export.plan.weight_specs()
    assert any(isinstance(s.algorithm, GPTQ) for s in specs.values())


def test_explicit_gptq_without_calibration_is_refused(digits):
    model, _, variables = SAMPLES["mlp"]()
    rules = [odmlq.Rule(".*", weight_qtype="int8", weight_algorithm="gptq")]
    with pytest.raises(odmlq.CalibrationError, match=r"dense1/kernel.*GPTQ.*needs the inputs.*odmlq.calibrate"):
        odmlq.ptq(model, rules, variables, example_inputs=(digits.x_test[:1],))


def test_optional_gptq_without_calibration_rounds_to_nearest(digits):
    model, _, variables = SAMPLES["mlp"]()
    x = digits.x_test[:8]
    optional = odmlq.ptq(model, [odmlq.Rule(".*", weight_qtype="int8", weight_algorithm=GPTQ(required=False))],
                         variables, example_inputs=(x[:1],))
    nearest = odmlq.ptq(model, [odmlq.Rule(".*", weight_qtype="int8", weight_algorithm=odmlq.Nearest())], variables,
                        example_inputs=(x[:1],))
    np.testing.assert_array_equal(np.asarray(optional(x)), np.asarray(nearest(x)))


@pytest.mark.parametrize("value,match", [
    ("adaround", r"weight_algorithm.*one of the names \['gptq', 'nearest'\]"),
    ({"algorithm": "gptq", "blocks": 3}, r"weight_algorithm.*unexpected keyword argument 'blocks'"),
    (GPTQ, r"weight_algorithm.*algorithm object"),
], ids=["unknown-name", "unknown-field", "a-class"])
def test_a_bad_algorithm_is_a_rule_error(value, match):
    with pytest.raises(odmlq.RuleError, match=match):
        odmlq.Rule(".*", weight_qtype="int8", weight_algorithm=value)


@pytest.mark.parametrize("kwargs,match", [
    ({"damping": 0}, r"damping=0.*\(0, 10\]"),
    ({"block_size": 0}, r"block_size=0.*positive int"),
    ({"act_order": "yes"}, r"act_order='yes'.*True or False"),
], ids=["damping", "block-size", "act-order"])
def test_bad_gptq_fields_are_rule_errors(kwargs, match):
    with pytest.raises(odmlq.RuleError, match=match):
        GPTQ(**kwargs)


def test_gptq_needs_an_integer_weight_type():
    with pytest.raises(odmlq.RuleError, match=r"weight_qtype='fp8_e4m3' is not an integer type"):
        odmlq.Rule(".*", weight_qtype="fp8_e4m3", weight_algorithm=GPTQ())


def test_the_default_is_gptq_where_calibration_reaches_the_weight():
    model, _, variables = SAMPLES["mlp"]()
    plan = odmlq.plan(model, [odmlq.Rule(".*", weight_qtype="int8")], np.zeros((1, 8, 8, 1), np.float32),
                      variables=variables)
    assert {s.algorithm for s in plan.weight_specs().values()} == {GPTQ(required=False)}
    nearest = odmlq.plan(model, [odmlq.Rule(".*", weight_qtype="int8", weight_algorithm="nearest")],
                         np.zeros((1, 8, 8, 1), np.float32), variables=variables)
    assert {s.algorithm for s in nearest.weight_specs().values()} == {None}


def test_algorithms_parse_from_names_and_dicts():
    assert parse_weight_algorithm("gptq") == GPTQ()
    assert parse_weight_algorithm({"algorithm": "gptq", "damping": 0.1}) == GPTQ(damping=0.1)
    assert parse_weight_algorithm(GPTQ(act_order=False).to_dict()) == GPTQ(act_order=False)


def test_stacked_scan_weights_refuse_a_required_gptq_and_round_an_optional_one_to_nearest():
    from tests.graph.test_graph import _Scanned

    model, x = _Scanned(), np.ones((2, 8), np.float32)
    with pytest.raises(odmlq.PlanError, match=r"layers/fc/kernel.*stacks layers along axes \[0\] \(nn.scan\).*"
                                              r"weight_algorithm=odmlq.Nearest\(\)"):
        odmlq.plan(model, [odmlq.Rule(".*", weight_qtype="int8", weight_algorithm=GPTQ())], x)
    optional = odmlq.plan(model, [odmlq.Rule(".*", weight_qtype="int8")], x)
    assert optional.weight_specs()["layers/fc/kernel"].algorithm is None


class _TwoLayouts(flax.linen.Module):
    """One kernel read as ``x @ w`` by one op and as ``y @ w.T`` by another."""

    @flax.linen.compact
    def __call__(self, x):
        w = self.param("w", flax.linen.initializers.lecun_normal(), (6, 6))
        return x @ w + (x * 2.0) @ w.T


def test_a_weight_read_in_two_layouts_is_named():
    model, x = _TwoLayouts(), np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    variables = model.init(jax.random.key(0), x)
    plan = odmlq.plan(model, [odmlq.Rule(".*", weight_qtype="int8", weight_algorithm=GPTQ())], x,
                      variables=variables)
    with pytest.raises(odmlq.CalibrationError, match=r"Weight 'w' is read in two layouts.*weight_algorithm=odmlq.Nearest"):
        odmlq.calibrate(model, plan, [x], variables=variables)
    optional = odmlq.plan(model, [odmlq.Rule(".*", weight_qtype="int8")], x, variables=variables)
    calibration = odmlq.calibrate(model, optional, [x], variables=variables)
    assert "w" not in calibration.grams  # optional: left out, rounded to nearest


def test_a_second_moment_that_is_not_finite_is_named():
    w = np.ones((2, 3))
    with pytest.raises(odmlq.CalibrationError, match=r"GPTQ for weight 'k': the inputs' second moment is not positive definite"):
        gptq_round(w, np.full_like(w, 0.1), None, -127, 127, np.full((3, 3), np.nan), GPTQ(), where="weight 'k'")


def test_quantize_params_with_a_prefix_refuses_a_rounded_weight(gptq_cnn):
    model, variables, export = gptq_cnn
    with pytest.raises(odmlq.PlanError, match=r"with a prefix .*weight_algorithm=odmlq\.Nearest\(\)"):
        odmlq.quantize_params(variables["params"]["conv1"], export.plan, prefix="conv1",
                              calibration=export.calibration)


@pytest.mark.parametrize("damage,match", [
    (lambda m: m["grams"][0].update(rows=0), r"input statistics are inconsistent"),
    (lambda m: m["grams"].append(dict(m["grams"][0])), r"lists weight .* twice"),
    (lambda m: m.update(grams=3), r"malformed list of weight input statistics"),
], ids=["no-rows", "twice", "not-a-list"])
def test_a_damaged_saved_calibration_is_named(gptq_cnn, damage, match):
    import json

    _, _, export = gptq_cnn
    data = json.loads(export.calibration.to_json())
    damage(data)
    with pytest.raises(odmlq.CalibrationError, match=match):
        Calibration.from_json(json.dumps(data))


def test_grams_that_cannot_be_merged_are_named():
    def gram(layout):
        return Gram(np.eye(2)[None], 4, layout, np.ones(1))

    calibration = Calibration()
    calibration.observe_gram("k", gram(WeightLayout((1,), (0,))))
    with pytest.raises(odmlq.CalibrationError, match=r"Weight 'k': the weight's inputs were observed with two layouts"):
        calibration.observe_gram("k", gram(WeightLayout((0,), (1,))))
    with pytest.raises(odmlq.CalibrationError, match=r"inputs of weight 'k' were observed in only one of them"):
        calibration.merge(Calibration())
