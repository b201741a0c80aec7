"""The bad-input catalogue: each case gets a named odmlq error that names the
culprit and says what to do, before any work where it can be known then, and
the user's files stay as they were. (Absurd and non-finite scales are in
tests/test_scales.py, a LiteRT abort in tests/litert/test_probe.py, an
io_dtype the model does not carry in tests/litert/test_schemas.py.)"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq
import odmlq.litert
from odmlq.errors import CalibrationError, OdmlqError, PlanError, RuleError, TraceError
from odmlq.litert.inspect import ModelFileError, inspect

INT8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="head")(nn.relu(nn.Dense(8, name="fc")(x)))


@pytest.fixture(scope="module")
def mlp():
    model = _Mlp()
    rng = np.random.default_rng(0)
    batches = [rng.normal(size=(8, 6)).astype(np.float32) for _ in range(3)]
    return model, model.init(jax.random.key(0), batches[0][:1]), batches


def _with(batches, index, value):
    out = [b.copy() for b in batches]
    out[index][0, 0] = value
    return out


@pytest.mark.parametrize("name, data, error, message", [
    ("nan", lambda b: _with(b, 1, np.nan), CalibrationError, r"rep_dataset batch 1, input 0: 1 NaN or Inf"),
    ("inf", lambda b: _with(b, 0, np.inf), CalibrationError, r"rep_dataset batch 0, input 0: 1 NaN or Inf"),
    ("no batches", lambda b: [], PlanError, r"needs example_inputs= or a non-empty rep_dataset"),
    ("empty batch", lambda b: [b[0][:0]], CalibrationError, r"batch 0, input 0 is empty \(shape \(0, 6\)\)"),
    ("strings", lambda b: ["abc"], CalibrationError, r"batch 0, input 0: str .* arrays? .* of numbers"),
    ("wrong rank", lambda b: [x[:, :, None] for x in b], TraceError,
     r"example inputs of shapes \[\(1, 6, 1\) float32\].*Check that the inputs have the shapes"),
    ("missing batch dimension", lambda b: [x[0] for x in b], TraceError,
     r"example inputs of shapes \[\(1,\) float32\].*Check that the inputs have the shapes"),
    ("other batches' shape", lambda b: [b[0], b[1][:, :5], b[2]], CalibrationError,
     r"rep_dataset batch 1, input 0: shape \(8, 5\) float32 does not match the example input"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_representative_data_is_named(mlp, tmp_path, name, data, error, message):
    model, variables, batches = mlp
    path = tmp_path / "model.tflite"
    with pytest.raises(error, match=message):
        odmlq.export_tflite(model, INT8, data(batches), path, variables=variables)
    assert not path.exists() and list(tmp_path.iterdir()) == []  # nothing half-written


def test_non_finite_weights_are_named_by_parameter(mlp):
    model, variables, batches = mlp
    broken = jax.tree_util.tree_map(lambda a: a, variables)
    broken["params"]["fc"]["kernel"] = broken["params"]["fc"]["kernel"].at[0, 0].set(jnp.inf)
    with pytest.raises(CalibrationError, match=r"Parameters with NaN or Inf values: 'fc/kernel' \(1 of 48\)"):
        odmlq.export_tflite(model, INT8, batches, variables=broken)
    plan = odmlq.plan(model, INT8, batches[0], variables=broken)
    with pytest.raises(CalibrationError, match=r"'fc/kernel'"):  # ptq's calibration too
        odmlq.calibrate(model, plan, batches, variables=broken)


@pytest.mark.parametrize("rules, message", [
    ("int8", r"rules is a str \('int8'\), not a list of odmlq.Rule.*odmlq.load_rules"),
    ([odmlq.Rule(".*", weight_qtype="int8"), "int8"], r"rules\[1\] is a str, not an odmlq.Rule"),
], ids=["a string", "a string in the list"])
def test_rules_that_are_not_rules_are_named(mlp, rules, message):
    model, variables, batches = mlp
    with pytest.raises(RuleError, match=message):
        odmlq.export_tflite(model, rules, batches, variables=variables)


@pytest.mark.parametrize("option, message", [
    ({"io_dtype": "int4"}, r"io_dtype='int4'; choose 'float', 'int8' or 'int16'"),
    ({"batch_size": 0}, r"batch_size=0: give an integer from 1 to the first batch's 8 rows"),
    ({"batch_size": 9}, r"batch_size=9: give an integer from 1"),
], ids=["io_dtype", "batch_size 0", "batch_size over the batch"])
def test_options_that_cannot_be_honoured_are_refused_before_work(mlp, tmp_path, option, message):
    model, variables, batches = mlp
    path = tmp_path / "model.tflite"
    path.write_bytes(b"the user's file")
    with pytest.raises(PlanError, match=message):
        odmlq.export_tflite(model, INT8, batches, path, variables=variables, **option)
    assert path.read_bytes() == b"the user's file"


def test_an_output_that_cannot_be_written_is_refused_before_any_work(mlp, tmp_path, monkeypatch):
    model, variables, batches = mlp
    import odmlq.litert._prepare as prepare

    def no_calibration(*args, **kwargs):  # the check comes first: nothing is calibrated or converted
        raise AssertionError("calibration ran before the output path was checked")

    monkeypatch.setattr(prepare, "calibrate", no_calibration)
    with pytest.raises(OdmlqError, match=r"it is a directory; give a file path, e.g. .*model.tflite"):
        odmlq.export_tflite(model, INT8, batches, tmp_path, variables=variables)
    with pytest.raises(OdmlqError, match=r"directory .*missing' does not exist"):
        odmlq.export_tflite(model, INT8, batches, tmp_path / "missing" / "m.tflite", variables=variables)
    assert list(tmp_path.iterdir()) == []


def test_an_existing_file_is_replaced_only_by_a_complete_verified_model(mlp, tmp_path):
    model, variables, batches = mlp
    path = tmp_path / "model.tflite"
    path.write_bytes(b"the user's file")
    with pytest.raises(CalibrationError):
        odmlq.export_tflite(model, INT8, _with(batches, 0, np.nan), path, variables=variables)
    assert path.read_bytes() == b"the user's file"  # a failed export leaves it
    result = odmlq.export_tflite(model, INT8, batches, path, variables=variables)
    assert path.read_bytes() == result.tflite and [p.name for p in tmp_path.iterdir()] == ["model.tflite"]


def test_truncated_and_foreign_tflite_files_are_named(mlp, tmp_path):
    model, variables, batches = mlp
    result = odmlq.export_tflite(model, INT8, batches, variables=variables)
    truncated = tmp_path / "truncated.tflite"
    truncated.write_bytes(result.tflite[: len(result.tflite) // 2])
    with pytest.raises(ModelFileError, match=r"has the .tflite identifier but is truncated or corrupt"):
        inspect(truncated)
    with pytest.raises(ModelFileError, match=r"is not a .tflite flatbuffer.*expected the file identifier"):
        inspect(b"\0" * 64)
    with pytest.raises(OdmlqError, match=r"LiteRT"):
        odmlq.litert.verify(truncated.read_bytes(), model, result.plan, result.scales, [batches[0]],
                            variables=variables)
    with pytest.raises(OdmlqError, match=r"LiteRT"):
        odmlq.compare(model, result.plan, result.scales, batches[0], variables=variables,
                      tflite=truncated.read_bytes())


def test_verification_also_runs_on_inputs_no_calibration_range_covers(mlp):
    """The held-back rows, then the first four scaled 1.5x (beyond every
    calibrated range) and with noise: 8 + 4 + 4 rows, every op checked."""
    model, variables, batches = mlp
    result = odmlq.export_tflite(model, INT8, batches, variables=variables)
    assert result.verification.samples == 16 and result.verification.passed


@pytest.mark.parametrize("rules", [[], [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")],
                                   [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)]])
def test_a_model_computing_in_bfloat16_is_refused_before_any_work(rules, tmp_path):
    """Before: litert-converter failed ('tfl.batch_matmul' ... marked illegal),
    or the plan asked for an int8 kernel of the bfloat16 casts."""

    class Bf16(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, dtype=jnp.bfloat16)(nn.relu(nn.Dense(16, dtype=jnp.bfloat16)(x)))

    model = Bf16()
    x = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    path = tmp_path / "model.tflite"
    with pytest.raises(PlanError, match=r"(?s)Dense_1.*bfloat16.*dtype=jnp.float32"):
        odmlq.export_tflite(model, rules, [x], str(path), variables=variables, benchmark=False)
    assert not path.exists()


class _TrainingNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.BatchNorm(use_running_average=False)(nn.Dense(4)(x))


def test_a_model_that_writes_a_collection_is_told_how_to_export_it():
    """A Flax decode=True cache or a BatchNorm in training mode writes a collection as the model
    runs; Flax refuses it unless applied with mutable=. The message said to check the inputs'
    shapes; it names the collection and the step function to export."""
    from tests.litert.test_flax_decode_cache import LENGTH, MODEL

    x = np.zeros((1, 6), np.float32)
    norm = _TrainingNorm()
    with pytest.raises(TraceError, match=r"writes its 'batch_stats' collection .*mutable=\['batch_stats'\].*"
                                         r"use_running_average=True"):
        odmlq.plan(norm, INT8, x, variables=norm.init(jax.random.key(0), x))
    variables = MODEL.init(jax.random.key(0), np.zeros((1, LENGTH), np.int32))
    with pytest.raises(TraceError, match=r"writes its 'cache' collection .*fn\(params, x, cache\) -> \(out, cache\)"):
        odmlq.plan(MODEL, INT8, np.zeros((1, 1), np.int32), variables=variables)


class _KeywordOnly(nn.Module):
    """As Flax's nlp_seq tagger writes its call: ``__call__(self, *, inputs, train)``."""

    @nn.compact
    def __call__(self, *, inputs, train):
        return nn.Dropout(0.5, deterministic=not train)(nn.Dense(3)(inputs))


def test_a_call_taking_keyword_only_arguments_is_told_the_method_that_passes_them():
    model, x = _KeywordOnly(), np.ones((2, 4), np.float32)
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    hint = (r"_KeywordOnly.__call__ takes keyword-only arguments \(inputs, train\) and odmlq passes a batch's "
            r"arrays positionally: pass method=lambda m, inputs: m\(inputs=inputs, train=\.\.\.\)")
    with pytest.raises(TraceError, match=hint):  # initialized from the example inputs
        odmlq.plan(model, rules, x)
    variables = model.init(jax.random.key(0), inputs=x, train=False)
    with pytest.raises(TraceError, match=hint):
        odmlq.plan(model, rules, x, variables=variables)
    # The method it names works, with or without variables (a Linen model is then initialized through it).
    method = lambda m, inputs: m(inputs=inputs, train=False)  # noqa: E731
    assert [op.kind for op in odmlq.plan(model, rules, x, method=method).graph.ops] == ["dot_general"]
    assert [op.kind for op in odmlq.plan(model, rules, x, variables=variables, method=method).graph.ops] == [
        "dot_general"]


def test_a_model_returning_no_array_is_told_to_return_its_outputs():
    """A __call__ that forgets its return: verification crashed with numpy's
    "need at least one array to concatenate"."""

    class _NoReturn(nn.Module):
        @nn.compact
        def __call__(self, x):
            nn.Dense(4)(x)

    model = _NoReturn()
    x = np.ones((2, 3), np.float32)
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(TraceError, match="returned PyTreeDef\\(None\\), no array.*Return the model's outputs"):
        odmlq.export_tflite(model, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")], [x, x],
                            variables=variables, benchmark=False)
