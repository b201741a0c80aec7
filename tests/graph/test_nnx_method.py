"""An NNX module's method= given as a function taking the module first (as
Linen's method= takes one) is what is traced; before, it was ignored and the
module's __call__ was traced: a silently different model."""

import numpy as np
import pytest
from flax import nnx

import odmlq


class _Two(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(4, 4, rngs=rngs)
        self.b = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.b(self.a(x))

    def half(self, x):
        return self.a(x)


def test_an_nnx_method_given_as_a_function_is_traced():
    model = _Two(nnx.Rngs(0))
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    plan = odmlq.plan(model, rules, x, method=lambda m, x: m.half(x))
    assert [op.kind for op in plan.graph.ops] == ["dot_general"]
    assert plan.graph.edges[plan.graph.outputs[0]].shape == (3, 4)


def test_a_plain_function_takes_an_nnx_module_first():
    model = _Two(nnx.Rngs(0))
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    plan = odmlq.plan(lambda m, x: m.half(x), [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")], x,
                      variables=model)
    assert [op.module_path for op in plan.graph.ops] == ["a"]


def test_a_plain_function_taking_an_nnx_module_exports_and_verifies():
    model = _Two(nnx.Rngs(0))
    data = [np.random.default_rng(i).standard_normal((1, 4)).astype(np.float32) for i in range(8)]
    result = odmlq.export_tflite(lambda m, x: m.half(x), [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")],
                                 data, variables=model, benchmark=False)
    assert result.verification.passed, str(result.verification)
    run = odmlq.litert.interpreter(result.tflite, num_threads=1).get_signature_runner()
    out = run(x=data[0])["output_0"]
    # One int8 Dense of 4x4 on inputs of ~1: the file is within 5% of its float range of the
    # float half (int8 input, weights and output: a few LSBs of error each).
    reference = np.asarray(model.half(data[0]))
    assert out.shape == (1, 4) and np.max(np.abs(out - reference)) <= 0.05 * np.max(np.abs(reference)) + 0.05


def test_a_function_closing_over_an_nnx_module_is_told_how_to_pass_it():
    model = _Two(nnx.Rngs(0))
    x = np.ones((1, 4), np.float32)
    with pytest.raises(odmlq.errors.TraceError,
                       match=r"reads the NNX module 'model' \(_Two\).*fn\(model, \*inputs\), and pass variables=model"):
        odmlq.plan(lambda x: model.half(x), [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")], x)


class _Masked(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x, mask=None):
        y = self.fc(x)
        return y if mask is None else y * mask


def test_a_none_input_carries_no_array():
    """A model called with None for an optional argument (a mask not given):
    the trace, the calibration and the .tflite take the other inputs only."""
    model = _Masked(nnx.Rngs(0))
    data = [(np.random.default_rng(i).standard_normal((1, 4)).astype(np.float32), None) for i in range(8)]
    result = odmlq.export_tflite(model, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")], data,
                                 benchmark=False)
    assert result.verification.passed, str(result.verification)
    runner = odmlq.litert.interpreter(result.tflite, num_threads=1)
    assert [d["shape"].tolist() for d in runner.get_input_details()] == [[1, 4]]
