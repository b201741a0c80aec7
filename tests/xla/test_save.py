"""save_params / load_params: safetensors round trips, and files of another plan refused."""

import os

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

import odmlq
from odmlq import OdmlqError, PerBlock, PlanError, QArray, Rule
from samples.models import SAMPLES

RULES = {
    "int8": [Rule(".*", weight_qtype="int8")],
    "int4-block16": [Rule("conv1", weight_qtype="int8"), Rule(".*", weight_qtype="int4", weight_granularity=PerBlock(16))],
    "fp8": [Rule(".*", weight_qtype="fp8_e4m3")],
    "nf4-block16": [Rule("conv1", weight_qtype="int8"), Rule(".*", weight_qtype="nf4", weight_granularity=PerBlock(16))],
    "int8-asymmetric": [Rule(".*", weight_qtype="int8", weight_symmetric=False)],
}


def _plan(name):
    model, (x,), variables = SAMPLES["cnn"]()
    return model, x, variables, odmlq.plan(model, RULES[name], x, variables=variables)


def _leaves(tree):
    return jax.tree_util.tree_leaves(tree)


@pytest.mark.parametrize("name", list(RULES))
def test_round_trip_keeps_every_stored_value_and_the_model_output(name, tmp_path):
    model, x, variables, plan = _plan(name)
    qmodel = odmlq.ptq(model, plan, variables)
    path = odmlq.save_params(tmp_path / "model.safetensors", qmodel.params, plan)
    assert os.listdir(tmp_path) == ["model.safetensors"]  # written atomically, no temp left
    loaded = odmlq.load_params(path, plan, like=qmodel.params)
    assert jax.tree.structure(loaded, is_leaf=lambda v: isinstance(v, QArray)) == jax.tree.structure(
        qmodel.params, is_leaf=lambda v: isinstance(v, QArray))
    for a, b in zip(_leaves(loaded), _leaves(qmodel.params)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))  # bit exact
    reloaded = odmlq.ptq(model, plan, loaded)
    np.testing.assert_array_equal(reloaded(x), qmodel(x))


def test_without_a_template_the_params_come_back_by_path(tmp_path):
    _, _, variables, plan = _plan("int8")
    path = odmlq.save_params(tmp_path / "p.safetensors", odmlq.quantize_params(variables, plan), plan)
    flat = odmlq.load_params(path, plan)
    assert sorted(flat) == sorted(plan.graph.params)
    assert isinstance(flat["conv2/kernel"], QArray) and flat["conv2/bias"].dtype == np.float32


def test_a_file_made_for_another_plan_is_refused_naming_what_differs(tmp_path):
    _, _, variables, int8 = _plan("int8")
    path = odmlq.save_params(tmp_path / "int8.safetensors", odmlq.quantize_params(variables, int8), int8)
    _, _, _, fp8 = _plan("fp8")
    with pytest.raises(PlanError, match=r"int8.safetensors holds params quantized for another plan .* 4 parameter\(s\) "
                                        r"differ: conv1/kernel: file \(3, 3, 1, 16\) float32 int8 per-channel.*"
                                        r"plan \(3, 3, 1, 16\) float32 fp8_e4m3"):
        odmlq.load_params(path, fp8)


def test_files_that_are_not_odmlq_params_are_refused(tmp_path):
    _, _, _, plan = _plan("int8")
    other = tmp_path / "other.safetensors"
    save_file({"w": np.zeros(3, np.float32)}, str(other))
    with pytest.raises(PlanError, match="not an odmlq quantized-params file"):
        odmlq.load_params(other, plan)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 5)
    with pytest.raises(PlanError, match="Cannot read .*garbage.safetensors as a safetensors file"):
        odmlq.load_params(garbage, plan)


def test_params_that_do_not_match_are_not_saved(tmp_path):
    _, _, variables, plan = _plan("int8")
    with pytest.raises(PlanError, match=r"missing \(2\): 'head/bias', 'head/kernel'"):
        odmlq.save_params(tmp_path / "p.safetensors",
                          {"params": {k: v for k, v in variables["params"].items() if k != "head"}}, plan)


def test_an_unwritable_directory_is_named(tmp_path):
    _, _, variables, plan = _plan("int8")
    with pytest.raises(OdmlqError, match="Cannot write .*no/such/dir"):
        odmlq.save_params(tmp_path / "no" / "such" / "dir" / "p.safetensors", variables, plan)
