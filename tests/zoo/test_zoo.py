"""Smoke tests of the model zoo (tests/zoo/models.py): models odmlq was not tuned on.

Per model: the float model runs on its batch-1 example and on a batch of 7
(finite, the batch dimension kept, each row independent of the others), and
`odmlq.plan` with int8 weights and activations either succeeds or raises an
`odmlq.OdmlqError` — which one is recorded (`record_property('plan', ...)`,
and printed with -s). Anything else escaping odmlq fails the test.

The hf_* models need transformers 4.x (the last line with Flax models); they
are skipped where it is not installed. bench/zoo.py measures the exports.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import odmlq
from tests.zoo.models import NEEDS_TRANSFORMERS, ZOO

RULES = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


def _zoo_model(name: str):
    if name in NEEDS_TRANSFORMERS:
        pytest.importorskip("transformers")
    return _build(name)


@functools.cache
def _build(name: str):
    return ZOO[name]()


def _params():
    return [pytest.param(name, id=name) for name in ZOO]


@pytest.mark.parametrize("name", _params())
def test_float_model_runs(name):
    z = _zoo_model(name)
    assert z.family in ("cnn", "transformer")
    assert all(isinstance(x, np.ndarray) and x.shape[0] == 1 for x in z.example_inputs)
    assert z.num_params < 2_000_000
    apply = jax.jit(z.apply)
    y1 = np.asarray(apply(*z.example_inputs))
    assert y1.shape[0] == 1 and np.isfinite(y1).all()
    (batch,) = z.make_batches(1, 7, 123)
    assert all(x.shape[0] == 7 for x in batch)
    y7 = np.asarray(apply(*batch))
    assert y7.shape == (7, *y1.shape[1:]) and np.isfinite(y7).all()
    # Rows do not see each other (BatchNorm in inference, masks per row).
    row = np.asarray(apply(*(x[3:4] for x in batch)))
    np.testing.assert_allclose(row, y7[3:4], rtol=1e-4, atol=1e-4 * float(np.abs(y7).max()))


@pytest.mark.parametrize("name", _params())
def test_plan_succeeds_or_raises_odmlq_error(name, record_property):
    z = _zoo_model(name)
    try:
        plan = odmlq.plan(z.model, RULES, *z.example_inputs, variables=z.variables)
    except odmlq.OdmlqError as error:
        outcome = f"{type(error).__name__}: {str(error)[:200]}"
    else:
        assert plan.graph.ops
        outcome = f"planned: {len(plan.graph.ops)} ops, {len(plan.float_ops)} float"
    record_property("plan", outcome)
    print(f"{name}: {outcome}")
