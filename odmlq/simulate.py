"""simulate: the quantized model evaluated in float — the reference semantics.

Every quantized weight and constant operand is fake-quantized (quantize then
dequantize), every int32 bias rounded to its grid, and every quantized edge
fake-quantized as it is produced. Backends must match this value for value
(LiteRT within 1 LSB of each edge's scale: integer kernels may round a half
step differently).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from odmlq.calibration import Calibration
from odmlq.graph import GraphCache, params_for
from odmlq.hooks import FakeQuant, PlanHooks
from odmlq.scales import Scales, compute_scales, folded_weights, quantized_params

__all__ = ["simulate", "Simulator"]


class Simulator:
    """A planned model with fixed scales, run many times (jitted per input shape).

    Example:
      >>> sim = Simulator(model, plan, scales, variables=variables)
      >>> logits, edges = sim(x, capture=True)
    """

    def __init__(self, model: Any, plan, scales: Scales, *, variables: Any = None):
        self.plan, self.scales = plan, scales
        self._graphs = GraphCache(model, plan, variables)
        self._qparams = quantized_params(
            folded_weights(plan.graph, params_for(model, variables, "simulate"), scales), scales)
        self._jitted: dict = {}

    def __call__(self, *inputs: Any, capture: bool = False,
                 feed: Mapping[str, Any] | None = None) -> Any:
        graph = self._graphs.graph_for(inputs)
        feed_values = {k: jnp.asarray(v) for k, v in (feed or {}).items()}
        key = (id(graph), capture, tuple(sorted(feed_values)))
        if key not in self._jitted:
            self._jitted[key] = jax.jit(self._runner(graph, capture))
        outputs, captured = self._jitted[key](self._qparams, feed_values, *inputs)
        return (outputs, captured) if capture else outputs

    def _runner(self, graph, capture: bool):
        plan, scales = self.plan, self.scales

        def run(qparams, feed_values, *xs):
            hooks = PlanHooks(plan, scales, FakeQuant(), capture=capture, feed=feed_values)
            return hooks.evaluate(graph, qparams, *xs), hooks.captured

        return run


def simulate(model: Any, plan, scales: Scales | Calibration, *inputs: Any, variables: Any = None,
             capture: bool = False, feed: Mapping[str, Any] | None = None) -> Any:
    """Runs `model` as `plan` quantizes it, in float.

    Args:
      model: the model the plan was made from (Linen: pass `variables`).
      plan: the Plan.
      scales: the `Scales` to quantize with, or a `Calibration` (scales are
        then computed from it, as the plan's constraints say).
      *inputs: the model's inputs (any batch size).
      capture: also return every edge's (fake-quantized) value, by edge id.
      feed: edge id -> value that replaces the edge's value after it has been
        captured, so that each op can be fed another run's tensors (this is how
        an export is checked op by op).

    Returns:
      The model's outputs, or ``(outputs, {edge_id: value})`` with `capture`.

    Example:
      >>> scales = odmlq.compute_scales(plan, calibration, variables)
      >>> logits = odmlq.simulate(model, plan, scales, x, variables=variables)
    """
    if isinstance(scales, Calibration):
        scales = compute_scales(plan, scales, params_for(model, variables, "simulate"))
    return Simulator(model, plan, scales, variables=variables)(*inputs, capture=capture, feed=feed)
