"""An op is named after the module that computes it, so that rules and reports
find it: in an NNX module (which opens no name scope of its own) and in a
Linen method other than __call__ (which Flax names 'Class.method')."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import odmlq
from odmlq import Rule

INT8 = [Rule(".*", weight_qtype="int8", act_qtype="int8")]


class _RMSNorm(nnx.Module):
    def __init__(self, dim: int, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.zeros((dim,)))

    def __call__(self, x):
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        return x * (1.0 + self.scale[...])


class _Sub(nnx.Linear):
    def __call__(self, x):  # calls its base class's __call__: one scope, not two
        return super().__call__(x) * 2.0


class _NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.proj = _Sub(8, 8, rngs=rngs)
        self.norms = nnx.List([_RMSNorm(8, rngs), _RMSNorm(8, rngs)])

    def __call__(self, x):
        h = self.norms[0](self.proj(x))
        return self.norms[1](x + h)


def test_nnx_ops_are_named_after_the_submodule_that_computes_them():
    model = _NnxBlock(nnx.Rngs(0))
    x = np.random.default_rng(0).normal(size=(1, 8)).astype(np.float32)
    before = np.asarray(model(x))
    plan = odmlq.plan(model, INT8, x)
    by_kind = {}
    for op in plan.graph.ops:
        by_kind.setdefault(op.kind, []).append(op.id)
    # Before, a norm's statistics took the path of the module whose output they read
    # ('proj/rsqrt', then 'norms/0/rsqrt' for the second norm's).
    assert by_kind["rsqrt"] == ["norms/0/rsqrt", "norms/1/rsqrt"]
    assert by_kind["dot_general"] == ["proj/dot_general"]
    assert [i for i in by_kind["mul"] if i.startswith("proj/")] == ["proj/mul"]
    # The classes' own __call__ is back once traced.
    assert _Sub.__call__.__qualname__ == "_Sub.__call__"
    np.testing.assert_array_equal(np.asarray(model(x)), before)


class _Encoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="dense")(x)


class _TwoMethods(nn.Module):
    def setup(self):
        self.encoder = _Encoder()
        self.embedding = nn.Embed(16, 8)

    def encode(self, x):
        return jax.nn.relu(self.encoder(x))

    def __call__(self, tokens):
        return self.embedding.attend(self.encode(self.embedding(tokens)))


def test_a_linen_method_is_named_after_its_module():
    model = _TwoMethods()
    tokens = np.arange(4, dtype=np.int32)[None]
    variables = model.init(jax.random.key(0), tokens)
    ids = [op.id for op in odmlq.plan(model, INT8, tokens, variables=variables).graph.ops]
    # Flax's scopes: '_TwoMethods/_TwoMethods.encode/encoder/dense', '_TwoMethods/embedding.attend'.
    assert "encoder/dense/dot_general" in ids
    assert any(i.startswith("embedding/") and "dot_general" in i for i in ids), ids
    assert not any("." in i for i in ids), ids
