"""Quantization-aware training: the Plan's fake quantization, made trainable.

`odmlq.qat(model, rules, rep_dataset, variables=...)` plans the model as
`ptq` and `export_tflite` do and returns a `QAT`. `QAT.apply(params, stats,
*inputs)` computes what `odmlq.simulate` computes for those params, and its
gradient passes every rounding straight through (zero where a value was
clipped), so it trains in the user's own loop (optax, `jax.jit`):

- each weight's scale is its absolute maximum at this step (per channel or
  block, as its rule says; widened where an int32 bias needs room, as
  `compute_scales` does), and it is rounded to nearest: training moves the
  weights. Training starts from the weights as the rules' algorithm rounded
  them (`QAT.params`: GPTQ's, by default, where calibration reaches a
  weight), its bias correction added to the offset a folded BatchNorm adds;
- each statically quantized edge takes its scale from `stats`, its range:
  at the start the calibrated ranges of `rep_dataset` (the rules' methods,
  as PTQ calibrates), so step 0 is the PTQ model. They stay fixed while the
  weights train; `QAT.calibrate(params, batches)` calibrates them afresh for
  the trained weights. (Measured on the digits CNN with int4 weights and
  3-bit activations: fixed ranges trained to 0.961-0.969 test accuracy;
  ranges moved each step toward the batch's minima and maxima, as TFLite's
  and PyTorch's moving-average observers do, to 0.84-0.91; recalibrated
  every 50-100 steps, to 0.88-0.91.)

The edges' scales come from the stats through `odmlq.compute_scales` itself,
so the constraints the targets put on edges (shared, fixed) hold while
training, and `QAT.calibration(stats)` gives `ptq` and `export_tflite` the
very scales the model trained with: ``q.export_tflite(params, stats, ...)``
writes a .tflite that computes ``q.apply(params, stats, x)`` within 1 LSB per
op (verified on export). The stats are read on the host when `apply` is
traced: close over them (``jax.jit(lambda p, x: q.apply(p, stats, x))``)
rather than passing them as traced arguments.

Example:
  >>> q = odmlq.qat(model, [odmlq.Rule('.*', weight_qtype='int4', act_qtype='int8')],
  ...               calibration_batches, variables=variables)
  >>> params, stats = q.params, q.stats
  >>> @jax.jit
  ... def step(params, opt_state, x, y):
  ...     grads = jax.grad(lambda p: cross_entropy(q.apply(p, stats, x), y))(params)
  ...     updates, opt_state = optimizer.update(grads, opt_state, params)
  ...     return optax.apply_updates(params, updates), opt_state
  >>> exported = q.export_tflite(params, stats, 'model.tflite', rep_dataset=calibration_batches)
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from odmlq.batches import model_inputs, sliced
from odmlq.algorithms import Nearest
from odmlq import litert, xla
from odmlq.calibration import (AbsMax, Calibration, FixedRange, MinMax, Statistics, calibrate, calibrated_edges,
                               channel_key)
from odmlq.errors import PlanError, RuleError
from odmlq.graph import (GraphCache, flat_params, fold_params, folded_bias, operand_values, params_for, params_tree,
                         replace_params, split_nnx, unfold_params)
from odmlq.hooks import PlanHooks
from odmlq.rules import Rule
from odmlq.plan import plan as plan_for_targets
from odmlq.scales import BIAS_LIMIT, Scales, bias_corrections, compute_scales, int32_bias_ops
from odmlq.training._straight import Straight, passed, traced_weight_scale

__all__ = ["QAT", "qat"]

# The targets a plan is made for, by name (as `odmlq.plan` names them).
_TARGETS = {"litert": (litert.TARGET,), "xla": (xla.TARGET,), "both": (xla.TARGET, litert.TARGET)}


def qat(model: Any, rules: Sequence[Rule], rep_dataset: Iterable | Callable[[], Iterable], *,
        variables: Any = None, example_inputs: Sequence[Any] | None = None, target: str = "both",
        progress: bool | None = None) -> "QAT":
    """Plans `model` for quantization-aware training (see the module doc).

    Args:
      model: a Linen module (pass `variables`) or an NNX module.
      rules: the rules, as for `ptq` and `export_tflite`. Their weight
        algorithm rounds the weights training starts from; a weight's
        calibration must be ``AbsMax`` (its scale follows the weight).
      rep_dataset: batches whose ranges start the stats (calibrated with the
        rules' methods, as for PTQ), and the data the weight algorithm reads.
      example_inputs: inputs fixing the traced shapes (default: the first row of the first batch).
      target: the targets to plan for ('both', 'litert' or 'xla'; see `odmlq.plan`).
      progress: a bar while calibrating (default: when stderr is a terminal).

    Raises:
      RuleError: a weight calibration QAT cannot follow (not ``AbsMax``).
      PlanError: no batches; the plan quantizes values derived from
        parameters where an op reads them as constants (names the ops).
    """
    if target not in _TARGETS:
        raise PlanError(f"target={target!r} is not a target; choose one of {sorted(_TARGETS)}.")
    rules = list(rules)
    batches = list(rep_dataset() if callable(rep_dataset) else rep_dataset)
    if not batches:
        raise PlanError("odmlq.qat needs at least one batch in rep_dataset to start the ranges from.")
    if example_inputs is None:
        example_inputs = sliced(model_inputs(batches[0]), 0, 1)
    start = plan_for_targets(model, rules, *example_inputs, variables=variables, target=_TARGETS[target])
    trained = plan_for_targets(model, [_held(r) for r in rules], *example_inputs, variables=variables,
                               target=_TARGETS[target])
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
        float_kernels = flat_params(fold_params(start.graph, params, start.weight_specs()))
        corrections = bias_corrections(start, float_kernels, rounded, calibration)
        params = _shifted(start.graph, unfold_params(start.graph, params, rounded), corrections)
    return QAT(model, trained, _stats_of(trained, calibration), params, start=start)


def _shifted(graph, params: Any, shifts: dict) -> Any:
    """`params` with each op's per-channel output shift (a bias correction)
    added to the parameter its folded epilogue adds last (a BatchNorm's
    offset), which adds it to the folded bias unchanged."""
    values, new, unplaced = flat_params(params), {}, []
    for op_id, shift in shifts.items():
        op = graph.op(op_id)
        kind, index, _ = op.attributes["fold"]["steps"][-1]
        param = op.operands[index].param
        value = None if param is None else np.asarray(values[param])
        if kind not in ("add", "sub") or value is None or value.size != np.size(shift):
            unplaced.append(op.module_path)
            continue
        sign = 1.0 if kind == "add" else -1.0
        new[param] = (value + sign * np.asarray(shift).reshape(value.shape)).astype(value.dtype)
    if unplaced:
        warnings.warn(f"QAT starts without the bias correction of {', '.join(unplaced[:5])}: no parameter "
                      "adds to their folded bias last.", stacklevel=3)
    return replace_params(params, new) if new else params


def _stats_of(plan, calibration: Calibration) -> dict:
    """Edge id -> {'min', 'max'}: the range of each of `plan`'s static edges,
    and the per-channel extremes of the operands of its balanced sums."""
    stats = {}
    for edge_id, spec in calibrated_edges(plan).items():
        lo, hi = calibration.range(edge_id, spec.qtype, symmetric=spec.symmetric)
        stats[edge_id] = {"min": np.asarray(lo, np.float32), "max": np.asarray(hi, np.float32)}
    for balanced in plan.balanced_sums:
        for edge_id in balanced.edges:
            if channel_key(edge_id) in calibration:
                found = calibration[channel_key(edge_id)][1]
                stats[channel_key(edge_id)] = {"min": np.asarray(found.min, np.float32),
                                               "max": np.asarray(found.max, np.float32)}
    return stats


def _rounded_to_nearest(rule: Rule) -> Rule:
    if rule.skip or rule.weight_qtype is None:
        return rule
    return dataclasses.replace(rule, weight_algorithm=Nearest())


def _held(rule: Rule) -> Rule:
    """The rule training follows: weights to nearest, edges at the ranges the stats hold."""
    rule = _rounded_to_nearest(rule)
    if rule.skip or rule.act_qtype is None or rule.act_dynamic or isinstance(rule.act_calibration, FixedRange):
        return rule
    return dataclasses.replace(rule, act_calibration=MinMax())


class QAT:
    """A model planned for quantization-aware training (made by `odmlq.qat`).

    Attributes:
      plan: the Plan training follows, and `ptq` / `export_tflite` export
        (weights to nearest, static edges at the min and max the stats hold).
      stats: the ranges training starts from: edge id -> ``{'min', 'max'}``
        (arrays of the edge's kept axes), the calibrated ranges.
      params: the params training starts from: the model's (Linen variables,
        an NNX module's state), with each weight the rules' algorithm
        rounds set to its rounded values.
    """

    def __init__(self, model: Any, plan, stats: dict, params: Any, *, start):
        self.model, self.plan, self.stats, self.params = model, plan, stats, params
        self._start = start  # the rules' own calibration methods, for `calibrate`
        self._keep = {e: spec.scale_axes for e, spec in calibrated_edges(plan).items()}
        self._keep.update({channel_key(e): (b.axis,) for b in plan.balanced_sums for e in b.edges})
        self._graphs = GraphCache(model, plan, None if _is_nnx(model) else params)
        self._specs = plan.weight_specs()
        self._template = compute_scales(plan, self.calibration(stats), params)
        self._host: tuple[Any, Scales] | None = None

    def calibrate(self, params: Any, rep_dataset: Iterable | Callable[[], Iterable], *,
                  progress: bool | None = None) -> dict:
        """Stats calibrated afresh for `params` by the rules' own calibration
        methods (global min/max with headroom by default), as PTQ calibrates:
        the ranges of the model as it is now trained, from the float model's
        activations on `rep_dataset`."""
        model, variables = self.model, params
        if _is_nnx(model):  # a module holding these params
            from flax import nnx

            graphdef, random_state, _ = split_nnx(model)
            model, variables = nnx.merge(graphdef, random_state, params), None
        return _stats_of(self.plan, calibrate(model, self._start, rep_dataset, variables=variables,
                                              progress=progress))

    def calibration(self, stats: dict) -> Calibration:
        """The stats as a `Calibration`: give it to `ptq` or `export_tflite`
        with `plan` to get the scales the model trained with."""
        entries = {}
        for key, value in stats.items():
            lo = np.asarray(value["min"], np.float64)
            hi = np.asarray(value["max"], np.float64)
            zeros = np.zeros_like(lo)
            entries[key] = (MinMax(), Statistics(
                count=np.ones(lo.shape, np.int64), min=lo, max=hi, sum=zeros, sum_of_squares=zeros,
                batches=np.asarray(1, np.int64), keep_axes=self._keep.get(key, ())))
        missing = sorted(set(calibrated_edges(self.plan)) - set(entries))
        if missing:
            raise PlanError(f"The QAT stats have no range for edge(s) {missing[:5]}; pass the stats odmlq.qat "
                            "made (QAT.stats) or QAT.calibrate returned.")
        return Calibration(entries)

    def scales(self, params: Any, stats: dict) -> Scales:
        """The `Scales` `apply` computes with, as numpy arrays."""
        found = self._scales(params, stats)

        def concrete(ts):
            return dataclasses.replace(ts, scale=np.asarray(ts.scale),
                                       zero_point=None if ts.zero_point is None else np.asarray(ts.zero_point))

        return dataclasses.replace(
            found, weights={p: concrete(ts) for p, ts in found.weights.items()},
            biases={p: np.asarray(b) for p, b in found.biases.items()},
            op_biases={o: np.asarray(b) for o, b in found.op_biases.items()})

    def apply(self, params: Any, stats: dict, *inputs: Any, capture: bool = False) -> Any:
        """The quantized model's outputs, differentiable in `params` (jittable).

        Args:
          params: the float params (Linen variables; an NNX module's state).
          stats: the edges' ranges (`QAT.stats`, or what `calibrate`
            returned), as concrete arrays: close over them under `jax.jit`.
          capture: also return every edge's value, by edge id.

        Returns:
          The outputs, and with `capture` ``(outputs, {edge id: value})``.

        Raises:
          PlanError: `stats` are traced (passed as an argument of a jitted function).
        """
        graph = self._graphs.graph_for(inputs)
        scales = self._scales(params, stats)
        folded = flat_params(fold_params(self.plan.graph, params, self._template.weights))
        new = {p: passed(folded[p], ts.fake_quant(jax.lax.stop_gradient(folded[p])))
               for p, ts in scales.weights.items()}
        new.update({p: Straight().folded_bias(None, folded[p], s) for p, s in scales.biases.items()})
        hooks = PlanHooks(self.plan, scales, Straight(), capture=capture)
        outputs = hooks.evaluate(graph, replace_params(fold_params(self.plan.graph, params, self._template.weights),
                                                       new), *inputs)
        return (outputs, hooks.captured) if capture else outputs

    def _scales(self, params: Any, stats: dict) -> Scales:
        """The edges' scales from `stats` (computed on the host), the weights'
        from `params` (in the traced program), and the int32 biases' from both."""
        host = self._edge_scales(stats)
        folded = flat_params(fold_params(self.plan.graph, params, self._template.weights))
        weights = {p: traced_weight_scale(folded[p], spec, self._template.weights[p])
                   for p, spec in self._specs.items()}
        biases, op_biases = {}, {}
        candidates = int32_bias_ops(self.plan, host)
        folds = {c.op.id for c in candidates if c.fold}
        operands = operand_values(self.plan.graph, params, folds) if folds else {}
        for c in candidates:
            ts = weights[c.kernel]
            # Room for the int32 bias, as `odmlq.scales.bias_room` makes it.
            if c.fold:
                bias = jnp.abs(folded_bias(c.op, operands[c.op.id]))
            else:
                bias = jnp.max(jnp.stack([jnp.abs(jnp.asarray(folded[b.param])).reshape(-1) for b in c.biases]), 0)
            needed = jax.lax.stop_gradient(bias) / (c.input_scale * BIAS_LIMIT)
            scale = jnp.asarray(ts.scale)
            needed = needed.reshape(scale.shape) if scale.size == needed.size else jnp.max(needed)
            ts = weights[c.kernel] = dataclasses.replace(ts, scale=jnp.maximum(scale, needed.astype(jnp.float32)))
            bias_scale = (jnp.asarray(ts.scale).reshape(-1) * c.input_scale).astype(jnp.float32)
            if c.fold:
                op_biases[c.op.id] = bias_scale
            else:
                biases.update({b.param: bias_scale for b in c.biases})
        return dataclasses.replace(host, weights=weights, biases=biases, op_biases=op_biases)

    def _edge_scales(self, stats: dict) -> Scales:
        leaves = jax.tree_util.tree_leaves(stats)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            raise PlanError(
                "QAT.apply reads the stats on the host, but these are traced (an argument of a jitted "
                "function); close over them instead: jax.jit(lambda params, x: q.apply(params, stats, x)).")
        if self._host is not None and len(self._host[0]) == len(leaves) and all(
                a is b for a, b in zip(self._host[0], leaves)):
            return self._host[1]
        with jax.ensure_compile_time_eval():  # numbers now, not ops of the traced program
            host = compute_scales(self.plan, self.calibration(stats), None, weight_scales=self._template.weights)
        self._host = (leaves, host)
        return host

    def ptq(self, params: Any, stats: dict, **kwargs: Any):
        """`odmlq.ptq` of the trained model with the trained ranges."""
        return xla.ptq(self.model, self.plan, params, self.calibration(stats), **kwargs)

    def export_tflite(self, params: Any, stats: dict, path=None, *, rep_dataset=None, **kwargs: Any):
        """`odmlq.export_tflite` of the trained model with the trained ranges
        (`rep_dataset`: batches to verify the file on)."""
        return litert.export_tflite(self.model, self.plan, rep_dataset, path, variables=params,
                             calibration=self.calibration(stats), **kwargs)


def _is_nnx(model: Any) -> bool:
    from flax import nnx

    return isinstance(model, nnx.Module)
