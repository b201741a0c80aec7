"""Matmuls of a constant matrix written activation first (internal; used by `_trace`).

``jax.image.resize`` (bilinear, cubic, lanczos) interpolates with
``dot_general(weights, x)``: the constant interpolation matrix is the left
operand. litert-converter 0.5.0 lowers a dot_general's left operand to
FULLY_CONNECTED's input and the right one to its weights, so the activation
became the "weights" (a float TRANSPOSE and FULLY_CONNECTED at every
invocation). Written as ``transpose(dot_general(x, weights))`` (the same
values), the constant is the weight: an int8 FULLY_CONNECTED reading it in
its own layout, and an int8 TRANSPOSE.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from odmlq.graph._program import _Lit, _Region, _Step


def activation_first_matmuls(walker, steps: list) -> None:
    """Rewrites each ``dot_general(constant, activation)`` of `steps` (and of scan bodies) in place."""
    for step in list(steps):
        if isinstance(step, _Region):
            activation_first_matmuls(walker, step.body.steps)
            continue
        if not isinstance(step, _Step) or step.kind != "dot_general" or step.eqn is None or step.einsum:
            continue
        lhs, rhs = step.ins[:2]
        if (isinstance(lhs, _Lit) or isinstance(rhs, _Lit) or lhs not in walker.weights
                or walker.weights[lhs].params or walker.is_weight(rhs)):
            continue
        (lc, rc), (lb, rb) = step.eqn.params["dimension_numbers"]
        if lb or rb:
            continue
        _swap(walker, steps, step, lhs, rhs, tuple(lc), tuple(rc))


def _swap(walker, steps: list, step, lhs, rhs, lc, rc) -> None:
    params = step.eqn.params
    def swapped(x, c):
        y = lax.dot_general(x, c, ((rc, lc), ((), ())), precision=params.get("precision"),
                            preferred_element_type=params.get("preferred_element_type"))
        nx, nc = x.ndim - len(rc), c.ndim - len(lc)
        return jnp.transpose(y, [nx + i for i in range(nc)] + list(range(nx)))

    new = walker.walk_function(swapped, [rhs, lhs], step.outs[0], step.stack)
    if new is None:
        return
    at = steps.index(step)
    steps[at:at + 1] = new
