"""ptq: a model for XLA serving whose weights are QArrays and whose matmuls run quantized.

`ptq(model, rules, params, calibration)` plans the model (or takes a Plan),
quantizes its weights (`quantize_params`), takes activation scales from the
calibration (static edges) and returns a `QuantizedModel`: `apply(params,
*inputs)` is a pure, jittable function of the quantized params, and calling
the model runs it jitted. The model is evaluated op by op from its traced
graph (`Graph.evaluate`): every quantized matmul / convolution becomes a
quantized kernel (`odmlq.xla._lowering`), every static edge is rounded to its
grid as `simulate` does (so results agree with `simulate` and with the LiteRT
export, clipping included), and only the inputs of integer kernels are
materialized as integers. An op that reads an input of another activation
qtype (`Plan.conversions`: an int16 op reading an int8 edge, an int8 op after a
skipped one) reads it at the conversion's scale, as `simulate` does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from odmlq.graph import GraphCache
from odmlq.calibration import Calibration
from odmlq.constraints import Target
from odmlq.errors import PlanError
from odmlq.graph import is_keras, is_nnx_module, keras_state, params_tree, split_nnx
from odmlq.hooks import FakeQuant, PlanHooks
from odmlq.plan import Plan, plan as make_plan
from odmlq.qarray import QArray
from odmlq.scales import Scales, TensorScale, compute_scales, fake_quant_bias
from odmlq.xla import _inputs, _lowering, _params

__all__ = ["ptq", "QuantizedModel", "TARGET"]

# XLA's kernels put no constraint on scales: every static edge is calibrated,
# and the quantized matmuls requantize to whatever scale the plan gives.
TARGET = Target(name="xla")


class QuantizedModel:
    """A planned model with quantized params, for XLA.

    Attributes:
      plan: the Plan it follows.
      scales: activation, bias and constant scales (`odmlq.Scales`).
      params: the model's params with each quantized weight a `QArray`
        (biases of integer ops rounded to their int32 grid).
      lowerings: op id -> `Lowering` (the kernel each quantized op runs, and
        whether it is emulated), for the example inputs' shapes.

    Raises:
      PlanError: `scales` lack the scale of a conversion of `plan`, or of a
        static edge a kernel reads (they were computed for another plan).

    Example:
      >>> qmodel = odmlq.ptq(model, rules, variables, calibration, example_inputs=(x,))
      >>> y = qmodel(x)                                   # jitted
      >>> y = jax.jit(qmodel.apply)(qmodel.params, x)     # or inside your own jit
      >>> print(qmodel)                                    # the kernel of each op
    """

    def __init__(self, model: Any, plan: Plan, params: Any, scales: Scales):
        self.plan, self.scales, self.params = plan, scales, params
        self.lowerings: dict[str, _lowering.Lowering] = {}
        traced, variables = _for_tracing(model, params)
        self._graphs = GraphCache(traced, plan, variables)
        self._dtypes = {p: np.dtype(d) for p, (_, d) in plan.graph.params.items()}
        # Inputs read through a conversion (Plan.conversions), checked against
        # the scales before anything runs.
        self._converted = _inputs.converted_inputs(plan, scales)
        self._jitted = jax.jit(self.apply, static_argnames=("capture",))
        examples = [jax.ShapeDtypeStruct(plan.graph.edges[e].shape, plan.graph.edges[e].dtype)
                    for e in plan.graph.inputs]
        if plan.graph.program is not None:  # (inputs as the model takes them: pytrees too)
            jax.eval_shape(self.apply, params, *plan.graph.structured_inputs(examples))  # records `lowerings`

    @property
    def nbytes(self) -> int:
        """Bytes of the params as stored (QArrays: codes, scales, zero points)."""
        leaves, _ = _params.flat_leaves(self.params)
        return sum(q.nbytes if isinstance(q, QArray) else int(np.asarray(q).nbytes) for _, q in leaves)

    def apply(self, params: Any, *inputs: Any, capture: bool = False,
              feed: Mapping[str, Any] | None = None) -> Any:
        """Runs the model on `params` (as `self.params`). Pure and jittable.

        Args:
          capture: also return every edge as the XLA path computes it.
          feed: edge id -> a value that replaces the edge after it is
            captured, so that each op runs on another run's tensors (an
            export's, say): the captured edges are then each op's own result.

        Returns:
          The model's outputs, or ``(outputs, {edge_id: value})`` with `capture`.
        """
        inputs, codes = self._state_in(inputs)
        graph = self._graphs.graph_for(inputs)
        leaves, tree = _params.flat_leaves(params)
        weights = {p: q for p, q in leaves if isinstance(q, QArray)}
        # The float view feeds only what no kernel replaces (a weight read
        # elsewhere too, an emulated op); under jit the rest is never computed.
        view = jax.tree_util.tree_unflatten(tree, [
            q.dequantize(self._dtypes.get(p, np.float32)) if isinstance(q, QArray) else q for p, q in leaves])
        lowerer = _lowering.Lowerer(graph, self.plan, self.scales, weights, self.lowerings, self._converted)
        kernels = _Kernels(self.plan, lowerer, self.scales, codes)
        hooks = PlanHooks(self.plan, self.scales, kernels, capture=capture, feed=feed)
        outputs = self._state_out(hooks.evaluate(graph, view, *inputs), kernels.codes)
        return (outputs, hooks.captured) if capture else outputs

    def __call__(self, *inputs: Any, capture: bool = False, feed: Mapping[str, Any] | None = None) -> Any:
        feed = None if feed is None else {k: jnp.asarray(v) for k, v in feed.items()}
        if any(map(_is_qarray, jax.tree_util.tree_leaves(inputs, is_leaf=_is_qarray))):  # state: run whole
            self._graphs.graph_for(self._state_in(inputs, shapes_only=True)[0])
            return self._jitted(self.params, *inputs, capture=capture, feed=feed)
        return self._graphs.run(inputs, lambda *xs: self._jitted(self.params, *xs, capture=capture, feed=feed),
                                capturing=capture or bool(feed))

    def _state_in(self, inputs: tuple, shapes_only: bool = False) -> tuple[tuple, dict]:
        """``(inputs, codes)``: each state input given as a QArray (what the last
        call returned) as its float value, and its codes by edge id. Indices
        count the inputs' leaves (a cache in a dict of arrays too)."""
        graph = self.plan.graph
        state = {graph.inputs.index(source): source for source, _ in self.plan.state}
        leaves, tree = jax.tree_util.tree_flatten(inputs, is_leaf=_is_qarray)
        out, codes = list(leaves), {}
        for i, x in enumerate(leaves):
            if not isinstance(x, QArray):
                continue
            edge = state.get(i)
            ts = self.scales.edges.get(edge)
            if ts is None:
                raise PlanError(f"Input leaf {i} of {graph.model_name} is a QArray, but only quantized state "
                                f"inputs (leaves {sorted(i for i, e in state.items() if e in self.scales.edges) or 'none'}"
                                ": plan with state={input: output} and a rule that quantizes the op writing it) "
                                "cross calls quantized; pass it as a float array.")
            _check_state_qarray(i, x, ts, graph.edges[edge].shape)
            dtype = graph.edges[edge].dtype
            if shapes_only:
                out[i] = jax.ShapeDtypeStruct(x.shape, dtype)
                continue
            codes[edge] = x.qvalue
            out[i] = _dequantized(x.qvalue, ts, dtype)
        return jax.tree_util.tree_unflatten(tree, out), codes

    def _state_out(self, outputs: Any, codes: Mapping[str, Any]) -> Any:
        """The model's outputs with each quantized state output a QArray on its
        edge's grid (its codes as the integer path made them, or quantized)."""
        graph = self.plan.graph
        quantized = {graph.outputs.index(result): graph.resolve(result) for _, result in self.plan.state
                     if graph.resolve(result) in self.scales.edges}
        if not quantized:
            return outputs
        leaves, tree = jax.tree_util.tree_flatten(outputs)
        for i, edge in quantized.items():
            ts = self.scales.edges[edge]
            leaves[i] = (_stored(codes[edge], ts, leaves[i].shape) if edge in codes else ts.quantize(leaves[i]))
        return jax.tree_util.tree_unflatten(tree, leaves)

    def __str__(self) -> str:
        rows = [("op", "schema", "kernel", "emulated")]
        rows += [(k, v.schema, v.kernel, v.emulated or "") for k, v in self.lowerings.items()]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines + [f"params: {self.nbytes} bytes; float ops: {len(self.plan.float_ops)}"])


class _Kernels(FakeQuant):
    """The XLA materializer (`odmlq.hooks`): static edges, constants and
    converted inputs rounded to their grid as `simulate` does; every quantized
    matmul or convolution replaced by its quantized kernel (`Lowerer`), which
    quantizes its dynamic input itself; other dynamic inputs (activation x
    activation) quantized here."""

    def __init__(self, plan, lowerer, scales=None, codes=None):
        self.plan, self.lowerer, self.scales = plan, lowerer, scales
        # Edge id -> integer codes of edges computed on them (state, and the
        # selects that write it): their float values are on the grid already.
        self.codes = dict(codes or {})

    def edge(self, edge_id, x, ts):
        return x if edge_id in self.codes else ts.fake_quant(x)

    def integer_sums(self, op) -> bool:
        # A matmul with a quantized weight gets its kernel from the Lowerer;
        # one of two activations sums their codes as simulate does.
        return _lowering.quantized_weight(self.plan, op) is None

    def dynamic_input(self, op, index, x, spec):
        if _lowering.quantized_weight(self.plan, op) is not None:
            return x
        return _lowering.dynamic_fake_quant(x, spec)

    def op(self, op, compute, operands):
        data = _CHOOSING.get(op.kind)
        if data is not None and any(op.inputs[i] in self.codes for i in data(len(op.inputs))):
            return self._chosen_codes(op, compute, operands, data(len(op.inputs)))
        return self.lowerer.on_op(op.id, compute, *operands)

    def _chosen_codes(self, op, compute, operands, data):
        """A write into a state given as codes (a KV-cache write: a select against
        the position, or a dynamic_update_slice) chooses codes: its new values
        quantized at the output's grid, the rest kept, then dequantized once. The
        same values as rounding the chosen floats (rounding is elementwise), with
        the new values rounded once instead of every element three times."""
        (out,) = op.outputs
        ts = self.scales.edges.get(out) if self.scales is not None else None
        shape = self.plan.graph.edges[out].shape
        usable = (ts is not None and ts.qtype.bits >= 8 and ts.rounding == "half_even" and ts.divisor == 1
                  and all(ts.same_grid(self.scales.edges.get(op.inputs[i])) if op.inputs[i] in self.codes
                          else all(np.shape(operands[i])[a] == shape[a] for a in ts.scale_axes) for i in data))
        if not usable:
            return self.lowerer.on_op(op.id, compute, *operands)  # the output edge rounds the choice
        chosen = list(operands)
        for i in data:
            chosen[i] = self.codes[op.inputs[i]] if op.inputs[i] in self.codes else ts.quantize(operands[i]).qvalue
        codes = (jax.lax.select_n(*chosen) if op.kind == "select_n"
                 else jax.lax.dynamic_update_slice(chosen[0], chosen[1], chosen[2:]))
        self.codes[out] = codes
        return [_dequantized(codes, ts, jnp.float32)]


# Ops that choose among their data operands' values, by kind: the data operands' indices.
_CHOOSING = {
    "select_n": lambda n: range(1, n),  # (predicate, *cases)
    "dynamic_update_slice": lambda n: (0, 1),  # (operand, update, *start indices)
}


def _is_qarray(x) -> bool:
    return isinstance(x, QArray)


def _dequantized(codes, ts, dtype):
    return QArray(qvalue=codes, scale=jnp.asarray(ts.scale), zero_point=None if ts.zero_point is None else
                  jnp.asarray(ts.zero_point), qtype=ts.qtype, shape=tuple(codes.shape), scale_axes=ts.scale_axes,
                  narrow_range=ts.narrow_range).dequantize(dtype)


def _stored(codes, ts, shape) -> QArray:
    return QArray(qvalue=codes, scale=jnp.asarray(ts.scale), zero_point=None if ts.zero_point is None else
                  jnp.asarray(ts.zero_point), qtype=ts.qtype, shape=tuple(shape), scale_axes=ts.scale_axes,
                  narrow_range=ts.narrow_range)


def _check_state_qarray(index: int, x: QArray, ts, shape) -> None:
    """A state QArray on the grid of the edge it is fed to (its static
    layout always; its scale where it is concrete, outside a trace)."""
    problem = None
    if x.qtype != ts.qtype or len(x.shape) != len(shape) or x.scale_axes != ts.scale_axes:
        problem = (f"{x!r}, where the plan's state input is {ts.qtype.name} of rank {len(shape)}"
                   + (f" with scale axes {ts.scale_axes}" if ts.scale_axes else " with one scale"))
    elif not isinstance(x.scale, jax.core.Tracer) and not isinstance(x.zero_point, jax.core.Tracer) \
            and not ts.same_grid(_as_scale(x)):
        problem = "a QArray quantized at another scale than this plan's state"
    if problem:
        raise PlanError(f"State input leaf {index} is {problem}; feed back what this model's last call returned "
                        "(or a float array).")


def _as_scale(x: QArray) -> TensorScale:
    return TensorScale(qtype=x.qtype, scale=np.asarray(x.scale), zero_point=None if x.zero_point is None else
                       np.asarray(x.zero_point), scale_axes=x.scale_axes, narrow_range=x.narrow_range)


def ptq(model: Any, rules: Sequence | Plan, params: Any = None, calibration: Calibration | None = None, *,
        example_inputs: Sequence[Any] | None = None,
        target: Target | Sequence[Target] = TARGET, method: Any = None,
        state: Mapping[int, int] | None = None) -> QuantizedModel:
    """Quantizes `model` for XLA: QArray weights, integer (or fp8) matmuls.

    The schema follows from the rules, as for the LiteRT export: weights alone
    give a weight-only model (int8, int4, fp8, nf4; per channel or per block;
    matmuls dequantize block by block); calibrated int8 activations a static
    one (int8 x int8 -> int32 matmuls and convolutions, one rescale);
    ``act_dynamic=True`` a dynamic-range one (activations quantized per call,
    per tensor or per row as the act granularity says).

    Args:
      model: a Linen module, an NNX module, or ``fn(params, *inputs)``.
      rules: rules (or a Plan made for this model).
      params: float params (Linen variables; for NNX default the module's
        own state), already quantized ones (`quantize_params`,
        `load_params`), or a mix.
      calibration: statistics for every static edge (`odmlq.calibrate`).
      example_inputs: inputs fixing the traced shapes (needed with rules).
      target: the targets to plan for when given rules (a Plan carries its
        own): XLA alone by default, whose kernels constrain no scale;
        ``odmlq.ptq`` plans for XLA and LiteRT, so that both compute the same.
      method: the Linen or NNX method to quantize (default: the model's
        call), as `odmlq.plan` takes it; a Plan carries its own. Two methods
        (a decoder's prefill and decode) share quantized params: pass one
        model's `params` to the other's `ptq`.
      state: ``{input index: output index}``: outputs the caller feeds back
        as inputs (a KV cache; see `odmlq.plan`). A state pair quantized by
        the rules is returned as a `QArray` on the pair's one grid and taken
        back as one, so it stays integer between calls (float accepted too,
        for the first call); a Plan carries its own.

    Returns:
      A `QuantizedModel`; `print` it to see the kernel of every quantized op.

    Raises:
      PlanError: params that do not match the plan (missing and extra paths
        listed), or QArrays quantized otherwise than the plan says.
      CalibrationError: a static edge without calibration statistics (names
        the edge; calibrate, or make its rule dynamic).

    Example:
      >>> rules = [odmlq.Rule('.*', weight_qtype='int8', act_qtype='int8', act_dynamic=True)]
      >>> qmodel = odmlq.ptq(model, rules, variables, example_inputs=(x,))
      >>> logits = qmodel(x)
    """
    if params is None:
        if is_nnx_module(model):
            params = params_tree(model)
        elif is_keras(model):
            params = keras_state(model)
        else:
            raise PlanError(f"ptq needs the params of {type(model).__name__}: pass them as params=...")
    if isinstance(rules, Plan):
        if state is not None and rules.state_indices != dict(state):
            raise PlanError(f"state={dict(state)}, but the plan given carries state={rules.state_indices}; "
                            "leave state out (the plan carries it) or plan with this state.")
        if method is not None and method != rules.graph.method:
            raise PlanError(f"method={method!r}, but the plan given traced {rules.graph.method or '__call__'!r}; "
                            "leave method out (the plan carries it) or plan that method.")
        plan = rules
    else:
        if example_inputs is None:
            raise PlanError("ptq with rules needs example_inputs=(x, ...) to trace the model "
                            "(or pass a Plan made with odmlq.plan).")
        traced, variables = _for_tracing(model, params)
        plan = make_plan(traced, rules, *example_inputs, variables=variables, method=method, target=target,
                         state=state)
    leaves, _ = _params.flat_leaves(params)
    _params.check_paths(dict(leaves), plan, partial=False)
    qparams = _params.quantize_params(params, plan, calibration=calibration)
    specs = _params.weight_specs(plan)
    leaves, tree = _params.flat_leaves(qparams)
    for path, leaf in leaves:
        if isinstance(leaf, QArray):
            if path not in specs:
                raise PlanError(f"Parameter {path!r} is a QArray but the plan keeps it in float; "
                                "pass its float value or use the plan the params were made with.")
            _params.check_qarray(path, leaf, specs[path])
    weight_scales = {p: _params.weight_scale_of(q) for p, q in leaves if isinstance(q, QArray)}
    # Bias corrections compare the rounded weights with the float ones: only
    # for the weights that ask for one, given float params (params already
    # quantized carry no float weights).
    corrected = {p for p, spec in specs.items() if getattr(spec.algorithm, "bias_correction", False)}
    given_float = corrected and not any(isinstance(q, QArray) for _, q in _params.flat_leaves(params)[0])
    rounded = {p: np.asarray(q.dequantize(np.float32)) for p, q in leaves
               if p in corrected and isinstance(q, QArray)} if given_float else None
    scales = compute_scales(plan, calibration, params, weight_scales=weight_scales, quantized=rounded)
    qparams = jax.tree_util.tree_unflatten(tree, [
        fake_quant_bias(jnp.asarray(leaf), scales.biases[p]) if p in scales.biases else leaf
        for p, leaf in leaves])
    return QuantizedModel(model, plan, qparams, scales)


def _abstract_params(model: Any, params: Any) -> Any:
    """What tracing needs of the params: shapes and dtypes (QArrays as float32)."""
    def abstract(x):
        if isinstance(x, QArray):
            return jax.ShapeDtypeStruct(x.shape, jnp.float32)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)

    return jax.tree_util.tree_map(abstract, params, is_leaf=_params.is_leaf)


def _for_tracing(model: Any, params: Any) -> tuple[Any, Any]:
    """``(model, variables)`` to trace the model for new input shapes, holding no
    weights: an NNX module is rebuilt around abstract state."""
    if is_nnx_module(model):
        from flax import nnx

        graphdef, rng_state, state = split_nnx(model)
        return nnx.merge(graphdef, rng_state, _abstract_params(model, state)), None
    return model, _abstract_params(model, params)
