"""An NNX module's method= given as a function taking the module first (as
Linen's method= takes one) is what is traced; before, it was ignored and the
module's __call__ was traced: a silently different model."""

import numpy as np
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
