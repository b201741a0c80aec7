"""simulate: the quantized model evaluated in float — the reference semantics.

Every quantized weight and constant operand is fake-quantized (quantize then
dequantize), every int32 bias rounded to its grid, and every quantized edge
fake-quantized as it is produced. Backends must match this value for value
(LiteRT within 1 LSB of each edge's scale: integer kernels may round a half
step differently).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from odmlq.calibration import Calibration
from odmlq.graph import GraphCache, params_for
from odmlq.hooks import FakeQuant, PlanHooks
from odmlq.qarray import QArray, float_dtype
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
        # Weights are held as their integers (a QArray: a quarter of float32 at
        # int8) and dequantized in the jitted run, which gives the values
        # fake_quant gives, bit for bit: a Simulator of a model of several GB
        # adds its integers, not a second float copy of the weights.
        self._qparams = quantized_params(
            folded_weights(plan.graph, params_for(model, variables, "simulate"), scales), scales,
            transform=_stored)
        self._jitted: dict = {}

    def __call__(self, *inputs: Any, capture: bool = False, capture_conversions: bool = False,
                 feed: Mapping[str, Any] | None = None, use_feed: bool = True) -> Any:
        """Runs the model on `inputs` (see `simulate`). `use_feed=False`:
        every edge keeps its own value, as without `feed`, computed by the
        program compiled for the fed run (one compile for both runs; a
        small BERT's takes about 3 s)."""
        return self._graphs.run(inputs, lambda *xs: self._run(xs, capture, capture_conversions, feed, use_feed),
                                capturing=capture or capture_conversions or bool(feed))

    def _run(self, inputs: tuple, capture: bool, capture_conversions: bool, feed, use_feed: bool) -> Any:
        graph = self._graphs.graph_for(inputs)
        feed_values = jax.tree_util.tree_map(jnp.asarray, dict(feed or {}))  # a loop's edge: {step: value}
        key = (id(graph), capture, capture_conversions, tuple(sorted(feed_values)))
        if key not in self._jitted:
            self._jitted[key] = jax.jit(self._runner(graph, capture, capture_conversions))
        outputs, captured = self._jitted[key](self._qparams, feed_values, jnp.asarray(use_feed), *inputs)
        return (outputs, captured) if capture or capture_conversions else outputs

    def _runner(self, graph, capture: bool, capture_conversions: bool):
        plan, scales = self.plan, self.scales

        def run(qparams, feed_values, feeding, *xs):
            qparams = jax.tree.map(lambda leaf: leaf.dequantize() if isinstance(leaf, _Stored) else leaf,
                                   qparams, is_leaf=lambda leaf: isinstance(leaf, _Stored))
            hooks = PlanHooks(plan, scales, FakeQuant(), capture=capture,
                              capture_conversions=capture_conversions, feed=feed_values, feeding=feeding)
            return hooks.evaluate(graph, qparams, *xs), hooks.captured

        return run


@functools.partial(jax.tree_util.register_dataclass, data_fields=["qarray"], meta_fields=["dtype"])
@dataclasses.dataclass(frozen=True)
class _Stored:
    """A weight as its QArray, and the float dtype fake_quant returns it in."""

    qarray: QArray
    dtype: Any

    def dequantize(self) -> jax.Array:
        return self.qarray.dequantize(self.dtype)


def _stored(path: str, value: Any, ts) -> Any:
    """A weight's integers, where its fake quantization is a plain quantize and
    dequantize (not a sum's, rounded half away or snapped to a divisor's grid)."""
    if ts.rounding != "half_even" or ts.divisor > 1 or ts.qtype.kind != "int":
        return ts.fake_quant(value)
    return _Stored(ts.quantize(value), float_dtype(value))


def simulate(model: Any, plan, scales: Scales | Calibration, *inputs: Any, variables: Any = None,
             capture: bool = False, capture_conversions: bool = False,
             feed: Mapping[str, Any] | None = None) -> Any:
    """Runs `model` as `plan` quantizes it, in float.

    Args:
      model: the model the plan was made from (Linen: pass `variables`).
      plan: the Plan.
      scales: the `Scales` to quantize with, or a `Calibration` (scales are
        then computed from it, as the plan's constraints say).
      *inputs: the model's inputs (any batch size).
      capture: also return every edge's (fake-quantized) value, by edge id;
        an edge inside a loop (or a loop's carry) as the stack of its steps.
      capture_conversions: return every input an op reads converted to its
        own qtype (`Plan.conversions`) too, under its conversion name
        (``<edge>/to_<qtype>``, `odmlq.plan.conversion_name`).
      feed: edge id (or conversion name) -> value that replaces the edge's
        value (or the converted input) after it has been captured, so that
        each op can be fed another run's tensors (this is how an export is
        checked op by op); for an edge inside a loop, the steps' stack or
        ``{step: value}`` for some of them.

    Returns:
      The model's outputs, or ``(outputs, {edge_id: value})`` with `capture`
      (or `capture_conversions`).

    Example:
      >>> scales = odmlq.compute_scales(plan, calibration, variables)
      >>> logits = odmlq.simulate(model, plan, scales, x, variables=variables)
    """
    if isinstance(scales, Calibration):
        scales = compute_scales(plan, scales, params_for(model, variables, "simulate"))
    return Simulator(model, plan, scales, variables=variables)(
        *inputs, capture=capture, capture_conversions=capture_conversions, feed=feed)
