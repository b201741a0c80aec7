"""Fused patterns: chains of traced primitives that are one op.

Some `jax.nn` functions are not kept as named calls: `gelu` (tanh
approximation) and `softmax` are traced as several elementwise and reduction
steps, `jnp.mean` as a sum and a division. Each is one op of the graph (one
output edge, one kernel on the target: LiteRT's GELU, SOFTMAX, MEAN), so that
nothing is quantized between its pieces: a fake-quant there would keep the
converter from recognising the function and cost accuracy.

A pattern is matched structurally on consecutive activation steps: the exact
primitive sequence, every operand either the pattern's one input, the output
of an earlier step of the pattern, or a scalar literal of a given value, and
no intermediate value used outside the pattern. Internal; used by
`_grouping`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from odmlq.graph._program import _Lit, _Step

X = "x"  # the pattern's input
ANY = object()  # any scalar literal (checked by the pattern's `check`)
_COMMUTATIVE = frozenset({"add", "mul", "max", "min"})


@dataclasses.dataclass(frozen=True)
class Pattern:
    """A chain of steps that is one op of kind `kind`.

    Attributes:
      kind: the op kind the chain becomes.
      steps: ``(primitive kind, operands)`` per step, in trace order; an
        operand is `X`, the index of an earlier step (its output), a float (a
        scalar literal of that value, to float32 precision) or `ANY`.
      check: further conditions on the matched steps (parameters, axes).
      attributes: the op's attributes, from the matched steps.
    """

    kind: str
    steps: tuple[tuple[str, tuple], ...]
    check: Callable[[Sequence[_Step]], bool] | None = None
    attributes: Callable[[Sequence[_Step]], dict] | None = None


def _is_cube(steps) -> bool:
    return steps[0].eqn.params.get("y") == 3


def _reduces_one_axis(steps) -> bool:
    axes = tuple(steps[0].eqn.params["axes"])
    return len(axes) == 1 and tuple(steps[6].eqn.params["axes"]) == axes


def _softmax_axis(steps) -> dict:
    return {"axis": int(steps[0].eqn.params["axes"][0])}


def _reduces_one_axis_moved(steps) -> bool:
    """The softmax under `jax.vmap`: the max is taken over one axis of the
    input, the sum over that axis after the transpose the batching put in."""
    axes, summed = tuple(steps[0].eqn.params["axes"]), tuple(steps[8].eqn.params["axes"])
    permutation = tuple(steps[5].eqn.params["permutation"])
    return len(axes) == 1 and len(summed) == 1 and permutation[summed[0]] == axes[0]


def _divides_by_count(steps) -> bool:
    shape = steps[0].eqn.invars[0].aval.shape
    count = math.prod(shape[a] for a in steps[0].eqn.params["axes"])
    divisor = next(r for r in steps[-1].ins if isinstance(r, _Lit))
    return float(np.asarray(divisor.value)) == float(count)


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_SQRT_HALF = math.sqrt(0.5)

PATTERNS: tuple[Pattern, ...] = (
    # jax.nn.gelu(x, approximate=True): x * 0.5 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))
    Pattern("gelu", (("integer_pow", (X,)), ("mul", (0.044715, 0)), ("add", (X, 1)),
                     ("mul", (_SQRT_2_OVER_PI, 2)), ("tanh", (3,)), ("add", (1.0, 4)),
                     ("mul", (0.5, 5)), ("mul", (X, 6))),
            check=_is_cube, attributes=lambda steps: {"approximate": True}),
    # jax.nn.gelu(x, approximate=False): 0.5 x erfc(-x / sqrt(2)) (the copy is JAX's)
    Pattern("gelu", (("mul", (0.5, X)), ("neg", (X,)), ("mul", (1, _SQRT_HALF)), ("erfc", (2,)),
                     ("mul", (0, 3)), ("copy", (4,))), attributes=lambda steps: {"approximate": False}),
    Pattern("gelu", (("mul", (0.5, X)), ("neg", (X,)), ("mul", (1, _SQRT_HALF)), ("erfc", (2,)),
                     ("mul", (0, 3))), attributes=lambda steps: {"approximate": False}),
    # The same with its negation as the graph writes it (-x is x * -1: `_canonical`).
    Pattern("gelu", (("mul", (0.5, X)), ("mul", (X, -1.0)), ("mul", (1, _SQRT_HALF)), ("erfc", (2,)),
                     ("mul", (0, 3)), ("copy", (4,))), attributes=lambda steps: {"approximate": False}),
    Pattern("gelu", (("mul", (0.5, X)), ("mul", (X, -1.0)), ("mul", (1, _SQRT_HALF)), ("erfc", (2,)),
                     ("mul", (0, 3))), attributes=lambda steps: {"approximate": False}),
    # jax.nn.softmax(x, axis): exp(x - stop_gradient(max(x))) / sum(...)
    Pattern("softmax", (("reduce_max", (X,)), ("max", (-math.inf, 0)), ("broadcast_in_dim", (1,)),
                        ("stop_gradient", (2,)), ("sub", (X, 3)), ("exp", (4,)),
                        ("reduce_sum", (5,)), ("broadcast_in_dim", (6,)), ("div", (5, 7))),
            check=_reduces_one_axis, attributes=_softmax_axis),
    # The same under jax.vmap (NNX's MultiHeadAttention): batching moved the
    # axes, so the input is transposed inside it; its axis is the output's.
    Pattern("softmax", (("reduce_max", (X,)), ("max", (-math.inf, 0)), ("transpose", (1,)),
                        ("broadcast_in_dim", (2,)), ("stop_gradient", (3,)), ("transpose", (X,)),
                        ("sub", (5, 4)), ("exp", (6,)), ("reduce_sum", (7,)), ("broadcast_in_dim", (8,)),
                        ("div", (7, 9))),
            check=_reduces_one_axis_moved,
            attributes=lambda steps: {"axis": int(steps[8].eqn.params["axes"][0]),
                                      "permutation": [int(a) for a in steps[5].eqn.params["permutation"]]}),
    # (hard_swish, x * relu6(x + 3) / 6, is not one op: its ADD, RELU6, MUL by 1/6 and MUL
    # are integer kernels XNNPACK runs, where LiteRT's HARD_SWISH is not: `_walk`.)
    # jnp.mean(x, axis, keepdims=False / True): a sum divided by the count.
    Pattern("mean", (("reduce_sum", (X,)), ("div", (0, ANY))), check=_divides_by_count),
    Pattern("mean", (("reduce_sum", (X,)), ("broadcast_in_dim", (0,)), ("div", (1, ANY))),
            check=_divides_by_count),
)


def match(steps: Sequence, start: int, uses, patterns: Sequence[Pattern] = PATTERNS) -> Pattern | None:
    """The first pattern that the steps from `start` on form, or None.

    Args:
      steps: activation steps in trace order.
      start: where the candidate chain begins.
      uses: value id -> number of uses in the whole program.
    """
    for pattern in patterns:
        window = steps[start:start + len(pattern.steps)]
        if len(window) == len(pattern.steps) and _matches(pattern, window, uses):
            return pattern
    return None


def _matches(pattern: Pattern, window: Sequence, uses) -> bool:
    if not all(isinstance(s, _Step) and s.eqn is not None and len(s.outs) == 1 for s in window):
        return False
    first = window[0]
    x = next((r for r in first.ins if not isinstance(r, _Lit)), None)
    if x is None:
        return False
    for step, (kind, operands) in zip(window, pattern.steps):
        if step.kind != kind or step.einsum or len(step.ins) != len(operands):
            return False
        orders = [operands, operands[::-1]] if kind in _COMMUTATIVE else [operands]
        if not any(all(_operand_matches(r, o, x, window) for r, o in zip(step.ins, order))
                   for order in orders):
            return False
    inside: dict[int, int] = {}
    for step in window:
        for r in step.ins:
            if not isinstance(r, _Lit):
                inside[r] = inside.get(r, 0) + 1
    if any(uses[s.outs[0]] != inside.get(s.outs[0], 0) for s in window[:-1]):
        return False  # an intermediate value is needed elsewhere
    return pattern.check is None or pattern.check(window)


def _operand_matches(r, operand, x, window) -> bool:
    if operand == X and isinstance(operand, str):
        return r == x and not isinstance(r, _Lit)
    if isinstance(operand, int) and not isinstance(operand, bool):
        return not isinstance(r, _Lit) and r == window[operand].outs[0]
    if not isinstance(r, _Lit) or np.size(r.value) != 1:
        return False
    if operand is ANY:
        return True
    value = float(np.asarray(r.value).reshape(()))
    if math.isinf(operand):
        return value == operand
    return math.isclose(value, operand, rel_tol=1e-6)
