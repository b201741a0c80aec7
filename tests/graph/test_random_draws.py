"""A model that draws random numbers from a key fixed at trace time (an
nnx.Rngs stream, Linen's rngs=) computes one draw, the same at every
invocation, in what odmlq quantizes and exports: it is told so, by module.
Flax's nnx_toy_examples/05_vae.py samples its latent in the encoder this way;
exported as called, the file held that one latent without a word."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import odmlq

RULES = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


class _Encoder(nnx.Module):
    def __init__(self, rngs):
        self.mean = nnx.Linear(4, 2, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        return self.mean(x) + jax.random.normal(self.rngs.noise(), (x.shape[0], 2))


class _Sampler(nnx.Module):
    def __init__(self, rngs):
        self.encoder = _Encoder(rngs)
        self.out = nnx.Linear(2, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(self.encoder(x))

    def decode(self, z):
        return self.out(z)


def _random_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if "draws random numbers" in str(w.message)]


def test_a_sampled_latent_is_named_and_a_method_that_does_not_sample_is_not():
    model = _Sampler(nnx.Rngs(0, noise=1))
    x = np.ones((2, 4), np.float32)
    sampled = _random_warnings(lambda: odmlq.plan(model, RULES, x))
    assert len(sampled) == 1 and "_Sampler draws random numbers from a key fixed when it is traced " \
        "(module 'encoder')" in sampled[0] and "pass the noise as an input" in sampled[0], sampled
    assert _random_warnings(lambda: odmlq.plan(model, RULES, np.ones((2, 2), np.float32), method="decode")) == []


class _Dropped(nn.Module):
    deterministic: bool

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.Dropout(0.5, deterministic=self.deterministic)(nn.Dense(8)(x)))


@pytest.mark.parametrize("deterministic", [True, False])
def test_dropout_in_training_mode_is_named(deterministic):
    model, x = _Dropped(deterministic), np.ones((2, 4), np.float32)
    variables, key = model.init(jax.random.key(0), x), jax.random.key(3)
    found = _random_warnings(lambda: odmlq.plan(lambda p, x: model.apply(p, x, rngs={"dropout": key}), RULES, x,
                                                variables=variables))
    if deterministic:
        assert found == []
    else:  # a plain function's ops are named by the scopes it calls: the Linen module's class first
        assert len(found) == 1 and "(module '_Dropped/Dropout_0')" in found[0], found


class _DeadSample(nnx.Module):
    """A draw whose value reaches no output (a decoder's samples under teacher forcing)."""

    def __init__(self, rngs):
        self.fc = nnx.Linear(4, 3, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        y = self.fc(x)
        self.sample = nnx.Variable(jax.random.categorical(self.rngs.noise(), y))
        return y


def test_a_draw_no_output_reads_is_not_named():
    model = _DeadSample(nnx.Rngs(0, noise=1))
    assert _random_warnings(lambda: odmlq.plan(model, RULES, np.ones((2, 4), np.float32))) == []
    assert jnp.shape(model(np.ones((2, 4), np.float32))) == (2, 3)
