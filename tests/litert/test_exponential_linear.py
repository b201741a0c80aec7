"""ELU, SELU and CELU kept in float (LiteRT has no integer kernel for them)
are written as MINIMUM, EXP, SUB and ADD, XNNPACK kernels all: jax.nn's
``where(x > 0, ...)`` converted to GREATER and SELECT, which XNNPACK does not
run, and split a model with one ELU into three partitions."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq
from odmlq.litert._forms import exponential_linear

FUNCTIONS = {"elu": jax.nn.elu, "elu_alpha_0.5": functools.partial(jax.nn.elu, alpha=0.5),
             "selu": jax.nn.selu, "celu": jax.nn.celu, "celu_alpha_2": functools.partial(jax.nn.celu, alpha=2.0)}


class _Block(nn.Module):
    name_of: str

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="out")(FUNCTIONS[self.name_of](nn.Dense(8, name="fc")(x)))


def _data(n=8):
    return [3 * np.random.default_rng(i).standard_normal((4, 4)).astype(np.float32) for i in range(n)]


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_kept_in_float_it_runs_in_one_xnnpack_partition(name):
    model, data = _Block(name), _data()
    variables = model.init(jax.random.key(0), data[0])
    kind = name.split("_")[0]
    for rules in ([odmlq.Rule(".*", skip=True)],
                  [odmlq.Rule(".*", op=kind, skip=True), odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]):
        result = odmlq.export_tflite(model, rules, data, variables=variables, allow_float_ops=True, benchmark=False)
        assert result.verification.passed, str(result.verification)
        histogram = result.summary.op_histogram
        assert "SELECT" not in histogram and "SELECT_V2" not in histogram and "GREATER" not in histogram, histogram
        assert histogram["EXP"] == 1 and histogram["FULLY_CONNECTED"] == 2, histogram
        assert result.delegation.partitions == 1 and not result.delegation.outside, result.delegation
    # The all-float file: the form is jax.nn's function to float32 rounding (inputs up to ~10,
    # outputs up to ~10: 1e-5 is about 20 float32 ulps of the largest).
    float_file = odmlq.export_tflite(model, [odmlq.Rule(".*", skip=True)], data, variables=variables,
                                     benchmark=False).tflite
    run = odmlq.litert.interpreter(float_file, num_threads=1).get_signature_runner()
    for x in data:
        np.testing.assert_allclose(run(x=x)["output_0"], np.asarray(model.apply(variables, x)), rtol=1e-5, atol=1e-5)


def test_a_function_of_another_form_keeps_its_own():
    """The form is read from the op as traced and used only where it gives the
    op's values: a function that is not ``s x`` above 0 and ``a (exp(x/b) - 1)``
    below is not rewritten."""
    for other in (jnp.tanh, jax.nn.softplus, lambda x: jnp.where(x > 0, x, 0.5 * jnp.expm1(x) + 0.01 * x)):
        assert exponential_linear(lambda x: [other(x)], (2, 3)) is None
    form = exponential_linear(lambda x: [jax.nn.selu(x)], (2, 3))
    grid = np.linspace(-40, 40, 801, dtype=np.float32)
    np.testing.assert_allclose(np.asarray(form(grid)), np.asarray(jax.nn.selu(grid)), rtol=1e-5, atol=1e-6)
