"""Quantization-aware training: the Plan's fake quantization, made trainable.

`odmlq.qat(model, rules, rep_dataset, variables=...)` plans the model as
`ptq` and `export_tflite` do and returns a `QAT`. `QAT.apply(params, stats,
*inputs)` computes what `odmlq.simulate` computes for those params, and its
gradient passes every rounding straight through (zero where a value was
clipped), so it trains in the user's own loop (optax, `jax.jit`):

- each weight's scale is its absolute maximum at this step (per channel or
  block, as its rule says), and it is rounded to nearest: training moves the
  weights. Training starts from the weights as the rules' algorithm rounded
  them (`QAT.params`: GPTQ's, by default, where calibration reaches a
  weight; its bias correction is not carried over);
- each statically quantized edge takes its scale from `stats`, its range
  tracked while training: ``apply(..., update_stats=True)`` also returns the
  stats moved toward this batch's minima and maxima (an exponential moving
  average, `momentum`), as TFLite's and PyTorch's QAT observers do. They
  start at the calibrated ranges of `rep_dataset` (the rules' calibration
  methods), so step 0 is exactly the PTQ model.

The edges' scales come from the stats through `odmlq.compute_scales` itself
(a host callback), so the scale constraints the targets put on edges
(shared, fixed) hold while training, and `QAT.calibration(stats)` gives
`ptq` and `export_tflite` the very scales the model trained with:
``q.export_tflite(params, stats, ...)`` writes a .tflite that matches
``q.apply(params, stats, x)`` within 1 LSB per edge (verified on export).

Example:
  >>> q = odmlq.qat(model, [odmlq.Rule('.*', weight_qtype='int4', act_qtype='int8')],
  ...               calibration_batches, variables=variables)
  >>> params, stats = q.params, q.stats
  >>> def loss(params, stats, x, y):
  ...     logits, stats = q.apply(params, stats, x, update_stats=True)
  ...     return cross_entropy(logits, y), stats
  >>> (l, stats), grads = jax.value_and_grad(loss, has_aux=True)(params, stats, x, y)
  >>> exported = q.export_tflite(params, stats, 'model.tflite', rep_dataset=calibration_batches)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from odmlq.algorithms import Nearest
from odmlq.calibration import AbsMax, Calibration, FixedRange, MovingAverageMinMax, Statistics, calibrate
from odmlq.calibration._reuse import calibrated_edges
from odmlq.errors import PlanError, RuleError
from odmlq.graph import GraphCache, flat_params, fold_params, params_for, params_tree, replace_params, unfold_params
from odmlq.hooks import PlanHooks
from odmlq.rules import Rule
from odmlq.scales import Scales, TensorScale, compute_scales
from odmlq.training._straight import Straight, passed, traced_weight_scale

__all__ = ["QAT", "qat"]

# The Scales fields that depend on the edges' ranges, computed on the host.
_HOST_FIELDS = ("edges", "conversions", "constants", "biases", "op_biases", "shifts")


def qat(model: Any, rules: Sequence[Rule], rep_dataset: Iterable | Callable[[], Iterable], *,
        variables: Any = None, example_inputs: Sequence[Any] | None = None, momentum: float = 0.9,
        target: str = "both", progress: bool | None = None) -> "QAT":
    """Plans `model` for quantization-aware training (see the module doc).

    Args:
      model: a Linen module (pass `variables`) or an NNX module.
      rules: the rules, as for `ptq` and `export_tflite`. Their weight
        algorithm rounds the weights training starts from; a weight's
        calibration must be ``AbsMax`` (its scale follows the weight).
      rep_dataset: batches whose ranges start the stats (calibrated with the
        rules' methods, as for PTQ), and the data the weight algorithm reads.
      example_inputs: inputs fixing the traced shapes (default: the first row of the first batch).
      momentum: weight of the running ranges at each ``update_stats`` step.
      target: the targets to plan for ('both', 'litert' or 'xla'; see `odmlq.plan`).
      progress: a bar while calibrating (default: when stderr is a terminal).

    Raises:
      RuleError: a weight calibration QAT cannot follow (not ``AbsMax``).
      PlanError: the plan quantizes values derived from parameters where an op
        reads them as constants (names the ops).
    """
    from odmlq.targets import plan as make_plan

    rules = list(rules)
    momentum = MovingAverageMinMax(momentum).momentum
    batches = list(rep_dataset() if callable(rep_dataset) else rep_dataset)
    if not batches:
        raise PlanError("odmlq.qat needs at least one batch in rep_dataset to start the ranges from.")
    if example_inputs is None:
        first = batches[0]
        example_inputs = tuple(np.asarray(x)[:1] for x in (first if isinstance(first, (tuple, list)) else (first,)))
    start = make_plan(model, rules, *example_inputs, variables=variables, target=target)
    trained = make_plan(model, [_tracked(_rounded_to_nearest(r), momentum) for r in rules], *example_inputs,
                        variables=variables, target=target)
    for param, spec in trained.weight_specs().items():
        if not isinstance(spec.calibration, AbsMax):
            raise RuleError(
                f"Weight {param!r}: quantization-aware training computes each weight's scale from its "
                f"absolute maximum at every step; weight_calibration={spec.calibration!r} is not supported. "
                "Use odmlq.AbsMax() (the default), with clip_ratio to clip.")
    derived = [op_id for op_id, op in trained.ops.items() if any(w.read_as is not None for w in op.weights)]
    if derived:
        raise PlanError(
            f"Quantization-aware training does not yet train values derived from parameters that ops read "
            f"as constants ({', '.join(derived[:5])}); keep these modules in float with a skip rule "
            "(Rule(path, skip=True)).")
    calibration = calibrate(model, start, batches, variables=variables, progress=progress)
    params = params_tree(params_for(model, variables, "odmlq.qat"))
    rounded = compute_scales(start, calibration, params).weight_values
    if rounded:  # training starts from the weights the rules' algorithm rounded
        params = unfold_params(start.graph, params, rounded)
    stats = {}
    for edge_id, spec in calibrated_edges(trained).items():
        lo, hi = calibration.range(edge_id, spec.qtype, symmetric=spec.symmetric)
        stats[edge_id] = {"min": jnp.asarray(lo, jnp.float32), "max": jnp.asarray(hi, jnp.float32)}
    return QAT(model, trained, stats, params)


def _rounded_to_nearest(rule: Rule) -> Rule:
    if rule.skip or rule.weight_qtype is None:
        return rule
    return dataclasses.replace(rule, weight_algorithm=Nearest())


def _tracked(rule: Rule, momentum: float) -> Rule:
    if rule.skip or rule.act_qtype is None or rule.act_dynamic or isinstance(rule.act_calibration, FixedRange):
        return rule
    return dataclasses.replace(rule, act_calibration=MovingAverageMinMax(momentum))


class QAT:
    """A model planned for quantization-aware training (made by `odmlq.qat`).

    Attributes:
      plan: the Plan training follows, and `ptq` / `export_tflite` export
        (static edges calibrated by ``MovingAverageMinMax``: the tracked stats).
      stats: the stats training starts from: edge id -> ``{'min', 'max'}``
        (arrays of the edge's kept axes), the calibrated ranges.
      params: the params training starts from: the model's (Linen variables,
        an NNX module's state), with each weight the rules' algorithm
        rounds set to its rounded values.
      momentum: the running ranges' momentum.
    """

    def __init__(self, model: Any, plan, stats: dict, params: Any):
        self.model, self.plan, self.stats, self.params = model, plan, stats, params
        self.momentum = next((s.calibration.momentum for s in calibrated_edges(plan).values()
                              if isinstance(s.calibration, MovingAverageMinMax)), 0.9)
        self._graphs = GraphCache(model, plan, None if _is_nnx(model) else params)
        self._specs = plan.weight_specs()
        self._axes = {e: s.scale_axes for e, s in calibrated_edges(plan).items()}
        self._template = compute_scales(plan, self.calibration(stats), params)
        self._host = _HostScales(plan, self._template, self)

    def calibration(self, stats: dict) -> Calibration:
        """The stats as a `Calibration`: give it to `ptq` or `export_tflite`
        with `plan` to get the scales the model trained with."""
        entries = {}
        specs = calibrated_edges(self.plan)
        for edge_id, spec in specs.items():
            if edge_id not in stats:
                raise PlanError(f"The QAT stats have no range for edge {edge_id!r}; pass the stats "
                                "QAT.apply returned (or QAT.stats).")
            lo = np.asarray(stats[edge_id]["min"], np.float64)
            hi = np.asarray(stats[edge_id]["max"], np.float64)
            zeros = np.zeros_like(lo)
            entries[edge_id] = (spec.calibration, Statistics(
                count=np.ones(lo.shape, np.int64), min=lo, max=hi, sum=zeros, sum_of_squares=zeros,
                batches=np.asarray(1, np.int64), moving_min=lo, moving_max=hi, keep_axes=spec.scale_axes))
        return Calibration(entries)

    def scales(self, params: Any, stats: dict) -> Scales:
        """The `Scales` `apply` computes with (on the host, numpy)."""
        folded = flat_params(fold_params(self.plan.graph, params, self._template.weights))
        weights = {p: traced_weight_scale(folded[p], spec, self._template.weights[p])
                   for p, spec in self._specs.items()}
        weights = {p: dataclasses.replace(ts, scale=np.asarray(ts.scale),
                                          zero_point=None if ts.zero_point is None else np.asarray(ts.zero_point))
                   for p, ts in weights.items()}
        return compute_scales(self.plan, self.calibration(stats), None, weight_scales=weights)

    def apply(self, params: Any, stats: dict, *inputs: Any, update_stats: bool = False,
              capture: bool = False) -> Any:
        """The quantized model's outputs, differentiable in `params` (jittable).

        Args:
          params: the float params (Linen variables; an NNX module's state).
          stats: the edges' ranges (`QAT.stats`, or what a previous
            ``update_stats`` call returned).
          update_stats: also return the stats moved toward this batch's ranges.
          capture: also return every edge's value, by edge id.

        Returns:
          The outputs; ``(outputs, stats)`` with `update_stats`; the captured
          edges last with `capture`.
        """
        graph = self._graphs.graph_for(inputs)
        folded = fold_params(self.plan.graph, params, self._template.weights)
        values = flat_params(folded)
        weights = {p: traced_weight_scale(values[p], spec, self._template.weights[p])
                   for p, spec in self._specs.items()}
        scales = dataclasses.replace(self._host(stats, weights), weights=weights)
        new = {p: passed(values[p], ts.fake_quant(jax.lax.stop_gradient(values[p])))
               for p, ts in weights.items()}
        new.update({p: Straight().folded_bias(None, values[p], s) for p, s in scales.biases.items()})
        hooks = _Tracking(self.plan, scales, Straight(), self._axes if update_stats else {}, capture=capture)
        outputs = hooks.evaluate(graph, replace_params(folded, new), *inputs)
        result = (outputs,)
        if update_stats:
            result += (self._moved(stats, hooks.seen),)
        if capture:
            result += (hooks.captured,)
        return result[0] if len(result) == 1 else result

    def _moved(self, stats: dict, seen: dict) -> dict:
        m = self.momentum
        out = dict(stats)
        for edge_id, (lo, hi) in seen.items():
            old = stats[edge_id]
            out[edge_id] = {"min": m * old["min"] + (1 - m) * lo, "max": m * old["max"] + (1 - m) * hi}
        return out

    def ptq(self, params: Any, stats: dict, **kwargs: Any):
        """`odmlq.ptq` of the trained model with the trained ranges."""
        from odmlq.targets import ptq

        return ptq(self.model, self.plan, params, self.calibration(stats), **kwargs)

    def export_tflite(self, params: Any, stats: dict, path=None, *, rep_dataset=None, **kwargs: Any):
        """`odmlq.export_tflite` of the trained model with the trained ranges
        (`rep_dataset`: batches to verify the file on)."""
        from odmlq.litert import export_tflite

        return export_tflite(self.model, self.plan, rep_dataset, path, variables=params,
                             calibration=self.calibration(stats), **kwargs)


def _is_nnx(model: Any) -> bool:
    from flax import nnx

    return isinstance(model, nnx.Module)


class _Tracking(PlanHooks):
    """`PlanHooks` that also keep each tracked edge's range as it is produced
    (before it is quantized)."""

    def __init__(self, plan, scales, materializer, tracked: dict, *, capture: bool):
        super().__init__(plan, scales, materializer, capture=capture)
        self.tracked, self.seen = tracked, {}

    def on_edge(self, edge_id: str, x: Any) -> Any:
        if edge_id in self.tracked:
            keep = self.tracked[edge_id]
            axes = tuple(a for a in range(jnp.ndim(x)) if a not in keep)
            raw = jax.lax.stop_gradient(x).astype(jnp.float32)
            self.seen[edge_id] = (jnp.min(raw, axis=axes), jnp.max(raw, axis=axes))
        return super().on_edge(edge_id, x)


class _HostScales:
    """The stats-dependent part of `Scales`, computed by `compute_scales` on
    the host from traced stats and weight scales (`jax.pure_callback`)."""

    def __init__(self, plan, template: Scales, owner: QAT):
        self.plan, self.template, self.owner = plan, template, owner
        self.layout = [(field, key) for field in _HOST_FIELDS for key in getattr(template, field)]
        self.shapes = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype)
                       for a in _arrays(template, self.layout)]

    def __call__(self, stats: dict, weights: dict[str, TensorScale]) -> Scales:
        names = sorted(weights)
        leaves = (stats, [(weights[p].scale, weights[p].zero_point) for p in names])

        def host(stats, weight_scales):
            given = {p: dataclasses.replace(self.template.weights[p], scale=np.asarray(s),
                                            zero_point=None if z is None else np.asarray(z))
                     for p, (s, z) in zip(names, weight_scales)}
            scales = compute_scales(self.plan, self.owner.calibration(stats), None, weight_scales=given)
            return [np.asarray(a, s.dtype) for a, s in zip(_arrays(scales, self.layout), self.shapes)]

        flat = jax.pure_callback(host, self.shapes, *jax.lax.stop_gradient(leaves))
        return _rebuilt(self.template, self.layout, iter(flat))


def _arrays(scales: Scales, layout) -> list:
    out = []
    for field, key in layout:
        value = getattr(scales, field)[key]
        if isinstance(value, TensorScale):
            out.append(value.scale)
            if value.zero_point is not None:
                out.append(value.zero_point)
        else:
            out.append(value)
    return out


def _rebuilt(template: Scales, layout, flat) -> Scales:
    fields: dict[str, dict] = {f: dict(getattr(template, f)) for f in _HOST_FIELDS}
    for field, key in layout:
        value = fields[field][key]
        if isinstance(value, TensorScale):
            scale = next(flat)
            zero_point = None if value.zero_point is None else next(flat)
            fields[field][key] = dataclasses.replace(value, scale=scale, zero_point=zero_point)
        else:
            fields[field][key] = next(flat)
    return dataclasses.replace(template, **fields)
