"""One hook set: what a resolved Plan and its Scales do to a graph as it runs.

`Graph.evaluate` calls a hook on every edge, every constant operand and every
op. `PlanHooks(plan, scales, materializer)` decides, once for every backend,
*where* quantization happens:

- each statically quantized edge, as it is produced (`Scales.edges`);
- each quantized constant operand, where its op reads it (`Scales.constants`),
  and each value derived from parameters that an op reads as one (`Scales.derived`);
- each input an op reads in its own activation qtype (`Plan.conversions`);
- each dynamic input a matmul/convolution kernel quantizes at run time;

and a `Materializer` says *how*: `simulate` fake-quantizes in float
(`FakeQuant`, the reference semantics), the LiteRT backend wraps the same
values in `quant.fake_quant` composites, the XLA backend runs quantized
kernels in `op`. None of them re-derives which edge or input is quantized.

Example:
  >>> hooks = PlanHooks(plan, scales, FakeQuant(), capture=True)
  >>> outputs = hooks.evaluate(graph, qparams, x)
  >>> hooks.captured["conv1/relu"]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from odmlq import _sums
from odmlq.graph import folded_bias, folded_operands, loop_edges
from odmlq.plan import QuantSpec, conversion_name, dynamic_kernel_inputs, input_conversion_scales
from odmlq.qarray import kernels as qkernels
from odmlq.qarray import compute_scale
from odmlq.qtypes import qtype as lookup_qtype
from odmlq.scales import Scales, TensorScale, fake_quant_bias

# Ops whose float constants litert-converter matches with the steps computing
# them (an average pool's window counts, a reduce_window of ones: AVERAGE_POOL_2D).
_PATTERN_CONSTANTS = frozenset({"avg_pool"})

__all__ = ["FakeQuant", "Materializer", "PlanHooks", "dynamic_fake_quant", "dynamic_quantize", "dynamic_scale"]


class Materializer(Protocol):
    """How a backend materializes each kind of quantization the plan places."""

    def edge(self, edge_id: str, x: jax.Array, ts: TensorScale) -> jax.Array: ...

    def constant(self, op, index: int, value: Any, ts: TensorScale) -> jax.Array: ...

    def converted_input(self, op, index: int, x: jax.Array, ts: TensorScale) -> jax.Array: ...

    def dynamic_input(self, op, index: int, x: jax.Array, spec: QuantSpec) -> jax.Array: ...

    def folded_bias(self, op, bias: jax.Array, scale) -> jax.Array: ...

    def op(self, op, compute: Callable, operands: list) -> list: ...


class FakeQuant:
    """The reference semantics: quantize then dequantize, in float; a matmul
    of two quantized operands sums their integer codes exactly, then scales
    (`odmlq._sums`: what integer kernels compute)."""

    def integer_sums(self, op) -> bool:
        """Whether `op`'s matmul of two quantized operands sums their codes
        (`odmlq._sums`). Materializers whose values are off the grids (blends,
        masks), that need gradients through the matmul, or that emit their own
        kernels say False."""
        return True

    def edge(self, edge_id: str, x: jax.Array, ts: TensorScale) -> jax.Array:
        return ts.fake_quant(x)

    def constant(self, op, index: int, value: Any, ts: TensorScale) -> jax.Array:
        return ts.fake_quant(jnp.asarray(value, jnp.float32))

    def converted_input(self, op, index: int, x: jax.Array, ts: TensorScale) -> jax.Array:
        return ts.fake_quant(x)

    def dynamic_input(self, op, index: int, x: jax.Array, spec: QuantSpec) -> jax.Array:
        return dynamic_fake_quant(x, spec)

    def folded_bias(self, op, bias: jax.Array, scale) -> jax.Array:
        """An op's folded bias (``b s + t``), rounded to its int32 grid."""
        return bias if scale is None else fake_quant_bias(bias, scale)

    def op(self, op, compute: Callable, operands: list) -> list:
        return compute(*operands)

    def stacked(self, edge_id: str, parts: list, ts: TensorScale | None) -> jax.Array | None:
        """A loop's per-step outputs joined into `edge_id` (None: ``jnp.stack``)."""
        return None


class PlanHooks:
    """`Graph.evaluate`'s hooks for one resolved Plan and its Scales.

    Args:
      materializer: how each quantization is made (`FakeQuant` by default).
      capture: keep every edge's value (after quantization) in `captured`.
      capture_conversions: keep every converted input (`Plan.conversions`) in
        `captured` too, under its `conversion_name` (``<edge>/to_<qtype>``).
      feed: edge id (or conversion name) -> a value that replaces the edge (or
        the converted input) after it is captured, so each op can be fed
        another run's tensors.
      feeding: a boolean scalar (traced, where the run is jitted): False
        leaves every edge its own value, as if nothing were fed, so one
        compiled program makes both runs.

    An edge computed inside a loop (or a loop's carry) takes a value at every
    step: it is captured as their stack (steps first, in the order they run)
    and fed from one, or from ``{step: value}`` for some steps.
    """

    def __init__(self, plan, scales: Scales, materializer: Materializer | None = None, *,
                 capture: bool = False, capture_conversions: bool = False,
                 feed: Mapping[str, Any] | None = None, feeding: Any = True):
        self.plan, self.scales = plan, scales
        self._feeding = feeding
        self.materializer = FakeQuant() if materializer is None else materializer
        self.capture, self.feed = capture, dict(feed or {})
        self.capture_conversions = capture_conversions
        self.captured: dict[str, Any] = {}
        self.graph = plan.graph
        self.converted = input_conversion_scales(plan, scales)
        self.dynamic = dynamic_kernel_inputs(plan, scales.int8_outputs)
        self.derived: dict[str, list[int]] = {}
        self.in_loops = loop_edges(plan.graph)
        self._steps: dict[str, int] = {}
        self._integer_sums = getattr(self.materializer, "integer_sums", None)
        for op_id, index in scales.derived:
            self.derived.setdefault(op_id, []).append(index)

    def on_edge(self, edge_id: str, x: Any) -> Any:
        ts = self.scales.edges.get(edge_id)
        if ts is not None:
            x = self.materializer.edge(edge_id, x, ts)
        if edge_id in self.in_loops:  # a step of its loop
            step = self._steps[edge_id] = self._steps.get(edge_id, -1) + 1
            if self.capture:
                self.captured.setdefault(edge_id, []).append(x)
            fed = self.feed.get(edge_id)  # the steps' stack, or {step: value} for some of them
            return self._fed(None if fed is None else fed.get(step) if isinstance(fed, Mapping) else fed[step], x)
        if self.capture:
            self.captured[edge_id] = x
        return self._fed(self.feed.get(edge_id), x)

    def _fed(self, fed: Any, x: Any) -> Any:
        """`fed` in place of `x` (None: `x`), where `feeding`."""
        if fed is None or self._feeding is True:
            return x if fed is None else fed
        return jnp.where(self._feeding, jnp.asarray(fed, jnp.result_type(x)).reshape(jnp.shape(x)), x)

    def on_stack(self, edge_id: str, parts: list) -> Any:
        return self.materializer.stacked(edge_id, parts, self.scales.edges.get(edge_id))

    def on_constant(self, op_id: str, index: int, value: Any) -> Any:
        op = self.graph.op(op_id)
        ts = self.scales.constants.get((op_id, index))
        folded = op.constants[index].value if index < len(op.constants) else None
        if (folded is not None and np.shape(folded) == np.shape(value)
                and (ts is not None or op.kind not in _PATTERN_CONSTANTS)):
            # The value folded at trace time: what reaches here may be the steps computing it
            # (a gather of a constant table at constant positions: transformers' rotary sines,
            # Marian's sinusoidal positions), which a converter leaves as ops, and its
            # quantization with them (or, in a float op, quantizes itself, as litert-converter's
            # dynamic-range mode does, and dequantizes at every invocation).
            value = folded
        if ts is None:
            return value
        return self.materializer.constant(op, index, value, ts)

    def on_op(self, op_id: str, compute: Callable, *operands) -> list:
        op = self.graph.op(op_id)
        operands = list(operands)
        grids = {} if self._integer_sums and op.kind == "dot_general" and self._integer_sums(op) else None
        for index, ts in self.converted.get(op_id, ()):
            operands[index] = self._converted(op, index, operands[index], ts)
            if grids is not None:
                grids[index] = _grid_of(ts, operands[index])
        for index, spec in self.dynamic.get(op_id, ()):
            if grids is not None:
                scale, zero_point = dynamic_scale(operands[index], spec)
                grids[index] = _sums.grid(spec.qtype, scale, zero_point, operands[index].shape)
            operands[index] = self.materializer.dynamic_input(op, index, operands[index], spec)
        for index in self.derived.get(op_id, ()):
            operands[index] = self.materializer.constant(op, index, operands[index],
                                                         self.scales.derived[(op_id, index)])
        if op.attributes.get("fold") and self._folded(op):
            # The kernel arrives folded (`fold_params`); the BatchNorm becomes its bias.
            # Computed on the host where the parameters are constants and the materializer
            # asks for it (the LiteRT export lays the bias out again: `_conv_transpose`).
            with (jax.ensure_compile_time_eval() if getattr(self.materializer, "host_folds", False)
                  else contextlib.nullcontext()):
                bias = folded_bias(op, operands)
                if op_id in self.scales.shifts:  # a balanced sum's offset (`Plan.balanced_sums`)
                    bias = bias + self.scales.shifts[op_id]
                bias = self.materializer.folded_bias(op, bias, self.scales.op_biases.get(op_id))
                operands = folded_operands(op, operands, bias)
        if grids is not None:
            compute = self._exact(op, compute, operands, grids)
        elif op.kind == "mean" and self._integer_sums and self._integer_sums(op):
            compute = self._mean_of_codes(op, compute, dict(self.converted.get(op_id, ())))
        return self.materializer.op(op, compute, operands)

    def _mean_of_codes(self, op, compute: Callable, converted: dict) -> Callable:
        """`compute` (a mean: linear) of a quantized input, taken on its codes
        then scaled, as an integer kernel sums them. Summed as float values, a
        mean near zero of large values (a LayerNorm's, after the residual
        add) kept the float32 rounding of its terms: dozens of LSB of the
        fine grid such a mean gets. Integer sums below 2^24 are exact in float32;
        a value off the input's grid adds the mean of its distance to the grid."""
        operand = op.operands[0]
        ts = converted.get(0)
        if ts is None and operand.role == "input" and operand.edge is not None:
            ts = self.scales.edges.get(self.graph.resolve(operand.edge))
        if ts is None or ts.scale_axes or np.size(ts.scale) != 1:
            return compute
        step = float(np.asarray(ts.scale).reshape(()))

        def on_codes(x, *rest):
            # What is off the grid (a float value a report feeds) is averaged as it is.
            codes = jnp.round(x / step)
            return [y * step + r for y, r in zip(compute(codes, *rest), compute(x - codes * step, *rest))]

        return on_codes

    def _converted(self, op, index: int, x: Any, ts: TensorScale) -> Any:
        """Input `index` of `op` converted to the op's qtype; captured and fed
        under its `conversion_name`."""
        x = self.materializer.converted_input(op, index, x, ts)
        if not (self.capture_conversions or self.feed):
            return x
        name = conversion_name(self.graph.resolve(op.operands[index].edge), str(ts.qtype))
        if self.capture_conversions:
            self.captured[name] = x
        return self._fed(self.feed.get(name), x)

    def _exact(self, op, compute: Callable, operands: list, grids: dict) -> Callable:
        """`compute` with its matmul of two quantized operands summed on the codes."""
        weight = None
        for index, operand in enumerate(op.operands):
            if index in grids:
                continue
            ts = None
            if operand.role == "weight":
                ts = self.scales.weights.get(operand.param)
                weight = index if ts is not None else weight
                if ts is not None:
                    # The op may read a view of the weight (a tied embedding, transposed):
                    # the grid knows which axes the weight contracts.
                    grids[index] = _grid_of(ts, operands[index], operand.contraction_axes)
                    continue
            elif operand.role == "input" and operand.edge is not None:
                ts = self.scales.edges.get(operand.edge)
            if ts is not None:
                grids[index] = _grid_of(ts, operands[index])
        for index in self.derived.get(op.id, ()):
            grids[index] = _grid_of(self.scales.derived[(op.id, index)], operands[index])
        grids = {i: g for i, g in grids.items() if g is not None}
        return _sums.integer_sums(compute, operands, grids, weight)

    def _folded(self, op) -> bool:
        """A BatchNorm is folded where its op's kernel is quantized (`fold_params`)."""
        return any(o.role == "weight" and o.param in self.scales.weights for o in op.operands)

    def evaluate(self, graph, params: Any, *inputs: Any) -> Any:
        """`graph.evaluate` with these hooks (the graph may be a re-trace of
        the plan's for other input shapes: same op and edge ids)."""
        self.graph, self._steps = graph, {}
        self.captured = {}
        out = graph.evaluate(params, *inputs, on_edge=self.on_edge, on_constant=self.on_constant,
                             on_op=self.on_op, on_stack=self.on_stack)
        self.captured = {e: jnp.stack(x) if isinstance(x, list) else x for e, x in self.captured.items()}
        return out


def dynamic_quantize(x: jax.Array, spec: QuantSpec) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """``(codes, scale, zero point)`` of `x` on its run-time range: the
    tensor's own min/max (per tensor or per channel), keepdims-shaped to `x`.
    Integer grids are computed as LiteRT's kernels compute them, multiplied
    by the reciprocal step (which rounds some values to the other
    neighbouring code than dividing by the step does): asymmetric as
    XNNPACK's dynamic-range kernels (`odmlq.qarray._kernels.dynamic_asymmetric`),
    symmetric as LiteRT's built-in hybrid kernels (`dynamic_symmetric`);
    others as `compute_scale` and `quantize` do."""
    axes = tuple(a for a in range(x.ndim) if a not in spec.scale_axes)
    lo, hi = jnp.min(x, axis=axes, keepdims=True), jnp.max(x, axis=axes, keepdims=True)
    qt = lookup_qtype(spec.qtype)
    bounds = qkernels.qrange(qt, False)
    if qt.is_integer:
        grid = qkernels.dynamic_symmetric if spec.symmetric else qkernels.dynamic_asymmetric
        codes, scale, zero_point = grid(x, lo, hi, bounds)
        return codes.astype(qkernels.kernel_for(qt).storage), scale, zero_point
    scale, zero_point = compute_scale(lo, hi, spec.qtype, symmetric=spec.symmetric)
    return qkernels.quantize_values(x, scale, zero_point, bounds, qkernels.kernel_for(qt), None, None), scale, \
        zero_point


def dynamic_scale(x: jax.Array, spec: QuantSpec) -> tuple[jax.Array, jax.Array | None]:
    """``(scale, zero point)`` of `x`'s run-time range (`dynamic_quantize`)."""
    return dynamic_quantize(x, spec)[1:]


def dynamic_fake_quant(x: jax.Array, spec: QuantSpec) -> jax.Array:
    """`x` on the grid of its run-time range (`dynamic_quantize`)."""
    codes, scale, zero_point = dynamic_quantize(x, spec)
    qt = lookup_qtype(spec.qtype)
    return qkernels.dequantize_values(codes, scale, zero_point, qkernels.kernel_for(qt), None, None).astype(x.dtype)


def _grid_of(ts: TensorScale, x: Any, contraction=None):
    return _sums.grid(ts.qtype, ts.scale, ts.zero_point, jnp.shape(x), ts.block_axis, ts.block_size, contraction)
