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

from odmlq._conversions import input_conversion_scales
from odmlq._edge_passes import dynamic_kernel_inputs
from odmlq._model_run import GraphCache, params_for
from odmlq.calibration import Calibration
from odmlq.qarray import compute_scale, fake_quant
from odmlq.scales import Scales, compute_scales, quantized_params

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
        self._qparams = quantized_params(params_for(model, variables, "simulate"), scales)
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
        scales, plan = self.scales, self.plan

        def run(qparams, feed_values, *xs):
            captured = {}

            def on_edge(edge_id, x):
                ts = scales.edges.get(edge_id)
                if ts is not None:
                    x = ts.fake_quant(x)
                if capture:
                    captured[edge_id] = x
                return feed_values.get(edge_id, x)

            def on_constant(op_id, index, value):
                ts = scales.constants.get((op_id, index))
                return value if ts is None else ts.fake_quant(jnp.asarray(value, jnp.float32))

            return graph.evaluate(qparams, *xs, on_edge=on_edge, on_constant=on_constant,
                                  on_op=on_op), captured

        converted = input_conversion_scales(plan, scales)
        at_run_time = dynamic_kernel_inputs(plan)

        def on_op(op_id, compute, *operands):
            if op_id in converted or op_id in at_run_time:
                operands = list(operands)
                for index, ts in converted.get(op_id, ()):
                    operands[index] = ts.fake_quant(operands[index])
                # Dynamic edges are quantized by the kernels that read them.
                for index, spec in at_run_time.get(op_id, ()):
                    operands[index] = _dynamic_fake_quant(operands[index], spec)
            return compute(*operands)

        return run


def simulate(model: Any, plan, scales: Scales | Calibration, *inputs: Any, variables: Any = None,
             capture: bool = False, feed: Mapping[str, Any] | None = None,
             constraints: Mapping | None = None) -> Any:
    """Runs `model` as `plan` quantizes it, in float.

    Args:
      model: the model the plan was made from (Linen: pass `variables`).
      plan: the Plan.
      scales: the `Scales` to quantize with, or a `Calibration` (scales are
        then computed with `constraints`).
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
        scales = compute_scales(plan, scales, params_for(model, variables, "simulate"), constraints)
    return Simulator(model, plan, scales, variables=variables)(*inputs, capture=capture, feed=feed)


def _dynamic_fake_quant(x: jax.Array, spec) -> jax.Array:
    """Run-time range: the tensor's own min/max (per tensor or per channel)."""
    axes = tuple(a for a in range(x.ndim) if a not in spec.scale_axes)
    lo, hi = jnp.min(x, axis=axes, keepdims=True), jnp.max(x, axis=axes, keepdims=True)
    scale, zero_point = compute_scale(lo, hi, spec.qtype, symmetric=spec.symmetric)
    return fake_quant(x, spec.qtype, scale=scale, zero_point=zero_point, scale_axes=spec.scale_axes)
