"""Annotation: the planned model as a JAX function with `quant.fake_quant`
composites on every quantized edge and weight, ready for litert-converter.

Protocol (litert-converter 0.5.0, strict QDQ mode): a composite named
``quant.fake_quant`` with one operand and the attributes ``dtype`` ('i8',
'i16', 'i4'), ``scale`` (1-D float32), ``zero_point`` (1-D int64),
``narrow_range`` (always present: jax drops a plain False attribute, and a
composite without it is left unlowered) and, per channel,
``quantization_dimension``. Its decomposition is the same fake-quant that
`odmlq.simulate` computes.

Weights are annotated in the layout LiteRT kernels store them in (output
channels first: (out, in) for FULLY_CONNECTED, OHWI for CONV_2D) and
transposed back for the op, so the converter folds the whole chain into one
constant and emits no DEQUANTIZE or TRANSPOSE at run time (`_weights`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from odmlq.errors import OdmlqError
from odmlq.litert.spec import (
    int16_full_shape_operand,
    padded_max_pool_reads_nonnegative,
    pool_as_depthwise,
    pool_pads_with_zeros, read_at_shared_scale,
    requantized_from_producer,
    scalar_divisor,
)
from odmlq.graph import MATMUL_KINDS, flat_params, replace_params
from odmlq.scales import Scales, TensorScale, fake_quant_bias, folded_weights
from odmlq.hooks import FakeQuant, PlanHooks
from odmlq.litert._blockwise import Blockwise, payload, placeholder
from odmlq.litert._external import Placeholder
from odmlq.litert._check import blockwise_weights
from odmlq.litert._composites import dynamic_range_composite, fake_quant_composite
from odmlq.litert._conv1d import average_pool_as_two_dimensional, one_dimensional_as_two
from odmlq.litert._conv_transpose import annotated_phases
from odmlq.litert._loops import annotated_layers, carry_starts, stacked_weights
from odmlq.litert._weights import annotated_weight, native_layouts, weight_placeholder, zeros
from odmlq.litert._forms import (EXPONENTIAL_LINEAR, added_at_one_shape, avg_pool_padded_with_zeros,
                                concatenated_by_padded_sums, exponential_linear, gathered_as_one_hot, gathered_in_fill_mode,
                                gathered_without_fill,
                                gelu_erf, gelu_in_int16, max_pool_padded_with_zeros, pool_as_depthwise_conv,
                                reciprocal_scale, rsqrt_in_pieces, scattered_as_sums, separated)


class Annotated(NamedTuple):
    """The function litert-converter converts, and what is written into its file afterwards."""

    fn: Callable
    # int4 weights in blocks, which `_blockwise.write_blockwise` puts in.
    blockwise: list[Blockwise]
    # Weights handed over as zeros (`external_weights`), which
    # `_external.externalized` writes after the flatbuffer.
    placeholders: list[Placeholder]


def annotated_function(graph, plan, scales: Scales, params: Any,
                       float_ops=(), *, external_weights: bool = False, rsqrt_pieces=None) -> Annotated:
    """A function of the model inputs only (weights are constants in it), and
    what the converted file needs put in afterwards (`Annotated`).

    `float_ops`: ops LiteRT must run in float (kept by a skip rule, or with no
    integer kernel), besides those no rule matched.
    `external_weights`: quantized weights of two or more dimensions become
    placeholders (zeros of their shape: see `_external`), written after the
    flatbuffer once converted.
    `rsqrt_pieces`: int16 RSQRT ops exported in pieces (op id -> `_tables.RsqrtPieces`)."""
    converted = {edge for edge, _ in scales.conversions}
    separated = frozenset(c.key for c in plan.conversions.values() if requantized_from_producer(plan, c))
    shared_reads = read_at_shared_scale(plan, scales)
    # Only a float op next to a quantized tensor can be quantized by the
    # converter; a float model keeps its file as it was.
    keep_float = frozenset(
        op_id for op_id in (*plan.float_ops, *float_ops)
        if any(plan.graph.resolve(e) in scales.edges for e in plan.graph.op(op_id).inputs)
        or any(e in scales.edges or e in converted for e in plan.graph.op(op_id).outputs))
    values = {k: np.asarray(v) for k, v in flat_params(folded_weights(plan.graph, params, scales)).items()}
    layouts = native_layouts(plan)
    # The converter re-derives the integers from the composite's input. Given
    # values already on the grid (our integers times the scale) it cannot round
    # a near-tie (w / s = -20.5000016) differently from us.
    # (One weight at a time where the weights are written after conversion.)
    def grid(p):
        return np.asarray(scales.weights[p].fake_quant(jnp.asarray(values[p])))

    on_grid = {} if external_weights else {p: grid(p) for p in scales.weights}
    # int4 weights in blocks are annotated per channel, and their blocks written
    # into the converted file (`_blockwise`): one placeholder and payload each.
    blockwise, stacked = blockwise_weights(plan), stacked_weights(plan)
    per_channel, payloads = {}, []
    for p, (_, input_axis, output_axis) in blockwise.items():
        values_on_grid = on_grid[p] if p in on_grid else grid(p)
        channel = placeholder(scales.weights[p])
        per_channel[p] = (channel, None if external_weights
                          else np.asarray(channel.fake_quant(jnp.asarray(values_on_grid))))
        payloads.append(payload(p, values_on_grid, scales.weights[p], input_axis, output_axis))
    for path, ts in scales.weights.items():
        if path in blockwise:
            continue  # annotated per channel; its blocks are written into the file (`_blockwise`)
        if (len(ts.scale_axes) > 1 and path not in stacked) or ts.block_size is not None:
            raise OdmlqError(f"Weight {path!r} has {ts.scale_axes} scale axes / blocks; LiteRT takes one "
                             "quantized dimension. This should have been refused by the plan check.")

    # A weight only float ops read (kept in float: no integer kernel) is stored
    # as its plan values in float: a quantized one would be dequantized at
    # every invocation.
    readers: dict[str, set] = {}
    for op, o in ((op, o) for op in plan.graph.ops for o in op.operands if o.param is not None):
        readers.setdefault(o.param, set()).add(op.id)
    float_only = {p for p in scales.weights if readers.get(p) and readers[p] <= keep_float}
    # A transposed convolution's kernel is laid out as its phases' filter, a constant of
    # the converted file (`_conv_transpose`), also where the other weights are written after it.
    phase_kernels = {o.param for op in plan.graph.ops if op.kind == "conv" and op.attributes.get("transposed")
                     for o in op.operands if o.role == "weight"}
    placeholders = {} if not external_weights else {
        p: weight_placeholder(p, np.shape(values[p]), scales.weights[p], layouts.get(p), grid,
                        [b for b in payloads if b.param == p])
        for p in scales.weights if p not in float_only | phase_kernels | stacked and np.ndim(values[p]) >= 2}

    def host_grid(p):
        with jax.ensure_compile_time_eval():
            return grid(p)

    def fn(*inputs):
        new = {}
        for p, ts in scales.weights.items():
            with jax.named_scope(p):
                if p in float_only:
                    new[p] = jnp.asarray(grid(p) if external_weights else on_grid[p])
                elif p in blockwise:
                    value = per_channel[p][1] if p not in placeholders else zeros(np.shape(values[p]))
                    new[p] = annotated_weight(value, per_channel[p][0], layouts.get(p))
                elif p in stacked:
                    new[p] = annotated_layers(on_grid[p] if p in on_grid else host_grid(p),
                                              ts, lambda v, t, p=p: annotated_weight(v, t, layouts.get(p)))
                elif p in placeholders:
                    new[p] = annotated_weight(zeros(np.shape(values[p])), ts, layouts.get(p))
                else:
                    new[p] = annotated_weight(on_grid[p] if p in on_grid else host_grid(p), ts, layouts.get(p))
        for p, s in scales.biases.items():
            new[p] = fake_quant_bias(jnp.asarray(values[p]), s)
        qparams = replace_params(params, new)

        # The graph evaluated may be a re-trace of the plan's at other input shapes:
        # full-shape int16 operands take its shapes.
        annotation = Annotation(scales, graph, keep_float, host_grid, separated, shared_reads, rsqrt_pieces)
        return PlanHooks(plan, scales, annotation).evaluate(graph, qparams, *inputs)

    return Annotated(fn, payloads, list(placeholders.values()))


# Ops that move values without computing: quantizing one changes nothing the
# plan cares about, and a barrier around a reshape kept the converter from
# quantizing the matmul after it (DEQUANTIZE of its weights at run time).
_LAYOUT_KINDS = frozenset({"reshape", "transpose", "squeeze", "broadcast_in_dim", "slice"})
_MOVING = _LAYOUT_KINDS | {"expand_dims", "rev", "gather"}


class Annotation(FakeQuant):
    """The LiteRT materializer (`odmlq.hooks`): every quantization the plan
    places becomes a `quant.fake_quant` composite the converter lowers.

    - an edge: a composite (per-channel activations are refused by the plan check);
    - a constant operand (the 0.5 of ``x * 0.5``): a composite around a value
      already on the grid, stored as an integer constant tensor;
    - an input read in the op's qtype: a composite, a QUANTIZE (requantize) on LiteRT;
    - a dynamic input: an identity marker; the hybrid kernel quantizes it per call;
    - ops the converter recognises only as a composite, or that lower better
      another way (an unpadded int8 average pool as a depthwise convolution,
      an int16 padded max pool after a ReLU as PAD + a VALID pool);
    - an int16 ADD's constant or weight operand: broadcast to the output's
      shape first (litert-converter takes only same-shaped int16 ADD operands);
    - constants and weights only float ops read: their plan values as float
      constants (quantized, they would be dequantized at every invocation);
    - ops the plan keeps in float: their inputs and outputs pass an
      optimization barrier. litert-converter quantizes a lone float op
      between a DEQUANTIZE and a QUANTIZE (a skipped tanh became an int8
      TANH), or after a DEQUANTIZE alone (a skipped maximum); the barrier,
      which lowers to nothing, keeps it float.
    """

    host_folds = True  # a folded BatchNorm's bias as a constant (`hooks`)

    def __init__(self, scales: Scales, graph, keep_float=frozenset(), grid=None, separated=frozenset(),
                 shared_reads=None, rsqrt_pieces=None):
        self.scales, self.graph, self.keep_float = scales, graph, keep_float
        self.rsqrt_pieces = rsqrt_pieces or {}  # int16 RSQRTs as pieces (`_tables.RsqrtPieces`)
        self.separated = separated  # conversions read after a same-scale MAXIMUM (`converted_input`)
        self.shared_reads = shared_reads or {}  # `spec.read_at_shared_scale`, read after one too
        self.grid = grid  # param -> its values on its grid (host), for kernels laid out here
        self.activated: set[str] = set()  # ReLUs applied where a transposed convolution's phases are
        self.marked_in_two_dimensions: set[str] = set()
        self.carry_starts = carry_starts(graph, scales)
        self.separators: dict[str, list] = {}  # the tensor a separator reads -> the grids it leads to

    def _separator(self, edge_id: str, target: TensorScale) -> int:
        """The form of `separated` on the tensor `edge_id` moves (through
        reshapes, slices, squeezes and transposes, which litert-converter may
        merge where two are equal) that requantizes it to `target`: one form
        per grid, so that the converter merges separators only where their
        requantizations are one and the same too."""
        edge_id = self.graph.resolve(edge_id)
        while (producer := self.graph.edges[edge_id].producer) is not None:
            op = self.graph.op(producer)
            moved = [e for e in op.inputs if self.graph.edges[e].is_float]
            if op.kind not in _MOVING or len(moved) != 1:
                break
            edge_id = self.graph.resolve(moved[0])
        grids = self.separators.setdefault(edge_id, [])
        found = next((i for i, grid in enumerate(grids) if grid.same_grid(target)), None)
        if found is None:
            grids.append(target)
            return len(grids) - 1
        return found

    def integer_sums(self, op) -> bool:
        return False  # the converter makes the integer kernels

    def edge(self, edge_id, x, ts):
        if ts.scale_axes or self._moved_beyond_five_axes(edge_id, x):
            return x
        start = self.carry_starts.pop(edge_id, None)  # a loop's first step: its carry's start
        with jax.named_scope(edge_id):
            return fake_quant_composite(x if start is None else separated(x, start, fake_quant_composite,
                                                                          self._separator(edge_id, ts)), ts)

    def constant(self, op, index, value, ts):
        if op.id in self.keep_float:
            # A float op reads the constant's plan value as a float constant
            # (quantized, it would be dequantized at every invocation).
            with jax.ensure_compile_time_eval():
                return ts.fake_quant(jnp.asarray(value, jnp.float32))
        if len(op.outputs) == 1:
            shape = self.graph.edges[op.outputs[0]].shape
            if int16_full_shape_operand(op, ts.qtype, value, shape):
                value = (jnp.broadcast_to(value, shape) if isinstance(value, jax.core.Tracer)
                         else np.broadcast_to(np.asarray(value), shape))
        # (A matmul reads only constants this way; elementwise ops read derived
        # values too, by operand index.)
        operand = op.constants[index] if op.kind in MATMUL_KINDS and index < len(op.constants) else None
        with jax.named_scope(f"{op.id}/constant_{index}"):
            if (operand is not None and operand.value is not None and np.ndim(operand.value) >= 2
                    and operand.channel_axes):
                # A constant matrix is stored like a weight, in the kernel's
                # layout (output channels first), so the converter folds the
                # transpose into it rather than transposing at every invocation;
                # from its value folded at trace time (what reaches here may be
                # the steps computing it, which the converter leaves as ops).
                channel = operand.channel_axes[0]
                perm = (channel, *[a for a in range(np.ndim(operand.value)) if a != channel])
                with jax.ensure_compile_time_eval():
                    native = ts.fake_quant(jnp.transpose(jnp.asarray(operand.value, jnp.float32), perm))
                return jnp.transpose(fake_quant_composite(native, ts), tuple(int(i) for i in np.argsort(perm)))
            # A value known now is put on its grid now: traced, the converter left
            # an int16 one's broadcast and rounding as ops ('tfl.add' then failed).
            with (contextlib.nullcontext() if isinstance(value, jax.core.Tracer)
                  else jax.ensure_compile_time_eval()):
                on_grid = ts.fake_quant(jnp.asarray(value, jnp.float32))
            return fake_quant_composite(on_grid, ts)

    def converted_input(self, op, index, x, ts):
        edge = self.graph.resolve(op.operands[index].edge)
        if (edge, str(ts.qtype)) in self.separated:  # `spec.requantized_from_producer`
            with jax.named_scope(f"{edge}/separated"):
                x = separated(x, self.scales.edges[edge], fake_quant_composite, self._separator(edge, ts))
        with jax.named_scope(f"{op.operands[index].edge}/to_{ts.qtype}"):
            return fake_quant_composite(x, ts)

    def stacked(self, edge_id, parts, ts):
        if ts is None or ts.qtype != "int16" or ts.scale_axes or len(parts) < 2:
            return None
        # An unrolled loop's int16 per-step outputs: CONCATENATION takes no int16 operand.
        with jax.named_scope(edge_id):
            return concatenated_by_padded_sums([jnp.expand_dims(p, 0) for p in parts], 0, ts, fake_quant_composite)

    def dynamic_input(self, op, index, x, spec):
        if not isinstance(x, jax.core.Tracer):
            # A constant (a loop's start state, computed at trace time) reaches the
            # kernel at run time: folded with it, the converter made the marker an
            # int8 tensor the hybrid kernel refuses, and the weight it shares with
            # the loop's later steps a float one.
            x = jax.lax.optimization_barrier(jnp.asarray(x))
        if op.kind == "conv" and (np.ndim(x) == 3 or op.attributes.get("transposed")):
            # A 1-D convolution's input (`_conv1d`), a transposed one's (`_conv_transpose`).
            self.marked_in_two_dimensions.add(op.id)
            return x
        contracted = sorted(op.operands[index].contraction_axes or ())
        with jax.named_scope(op.operands[index].edge):
            if op.kind in ("dot_general", "einsum") and len(contracted) > 1 and \
                    contracted == list(range(np.ndim(x) - len(contracted), np.ndim(x))):
                # Several trailing axes contracted (``'btnh,nhd->btd'``: attention's
                # output projection as nnx.Einsum writes it): marked with them
                # merged into one, as FULLY_CONNECTED reads it. Marked as it is,
                # litert-converter 0.5.0 dropped the merging reshape and fed the
                # kernel the unmerged input, whose output then came out 2-D
                # (its readers failed to prepare: "Invalid axis index").
                merged = (*np.shape(x)[:-len(contracted)], -1)
                return jnp.reshape(dynamic_range_composite(jnp.reshape(x, merged)), np.shape(x))
            return dynamic_range_composite(x)

    def _quantized_table(self, op) -> bool:
        """A gather of a weight whose values are int8 in the file (its output quantized, or
        an int8 table in a dynamic-range or weight-only export)."""
        table = next((o for o in op.operands if o.role == "weight"), None)
        return table is not None and (_qtype(self.scales, op) is not None
                                      or self.scales.weights.get(table.param) is not None)

    def _moved_beyond_five_axes(self, edge_id: str, x) -> bool:
        """A reshape or transpose output of more than 5 axes (a pixel shuffle's
        depth-to-space: NHWC to 6 axes, transposed, back to NHWC), or a gather's
        or flip's at its input's scale, is left unmarked: litert-converter 0.5.0
        cannot lower a 6-axis quantize marker (its clamp fails to legalize), and
        the op keeps its input's scale anyway, so the converter carries the
        integers through."""
        if np.ndim(x) <= 5:
            return False
        producer = self.graph.edges[edge_id].producer
        if producer is None:
            return False
        op = self.graph.op(producer)
        if op.kind in _LAYOUT_KINDS:
            return True
        # A gather or flip of an activation (BigBird's random key blocks, gathered to
        # 6 axes) keeps its input's scale too: the same integers, moved.
        moved = [e for e in op.inputs if self.graph.edges[e].is_float]
        return (op.kind in ("gather", "rev") and len(moved) == 1 and (ts := self.scales.edges.get(edge_id))
                is not None and ts.same_grid(self.scales.edges.get(self.graph.resolve(moved[0]))))

    def _read_after_layout(self, op) -> TensorScale | None:
        """The scale of the activation an int16 square, MUL or ADD reads twice,
        or an int16 ADD reads beside a constant, where a reshape or transpose
        wrote it (Flax's GroupNorm squares its (..., groups, channels) view, and
        adds its epsilon to a statistic reshaped to broadcast). litert-converter
        0.5.0 moves the layout op past the MUL or ADD, and fails ('tfl.reshape'
        op quantization parameters violate the same scale constraint; 'tfl.add'
        op failed to verify): read through `separated`, it stays in place."""
        reads = [o for o in op.operands if o.role == "input"]
        if (_qtype(self.scales, op) != "int16" or not reads or reads[0].edge is None
                or not ((len(reads) == 1 and op.kind in ("square", "add"))
                        or (len(reads) == 2 and op.kind in ("mul", "add") and reads[0].edge == reads[1].edge))):
            return None
        producer = self.graph.edges[self.graph.resolve(reads[0].edge)].producer
        if producer is None or self.graph.op(producer).kind not in _LAYOUT_KINDS:
            return None
        return ts if (ts := self._read_at(reads[0])) is not None and ts.qtype == "int16" and not ts.scale_axes else None

    def _read_at(self, operand) -> TensorScale | None:
        """The scale an int16 op reads an activation operand at (its conversion's, or its edge's)."""
        edge = self.graph.resolve(operand.edge) if operand.role == "input" and operand.edge is not None else None
        return None if edge is None else self.scales.conversions.get((edge, "int16"), self.scales.edges.get(edge))

    def _reciprocal(self, op, divisor: float) -> jax.Array:
        """1 / divisor, quantized as the divisor is (a float op's plain float)."""
        value = np.asarray(1.0 / divisor, np.float32)
        if (ts := self.scales.constants.get((op.id, 0))) is None:  # the op's one constant
            return value
        ts = reciprocal_scale(ts, float(value))
        with jax.named_scope(f"{op.id}/constant_0"):
            return fake_quant_composite(ts.fake_quant(jnp.asarray(value)), ts)

    def op(self, op, compute, inputs):
        """An op as LiteRT computes it (`_compute`); a float one between optimization barriers."""
        if op.id in self.keep_float and op.kind not in _LAYOUT_KINDS:
            inputs = [jax.lax.optimization_barrier(x) if o.role == "input" else x
                      for o, x in zip(op.operands, inputs)]
            return [jax.lax.optimization_barrier(y) for y in self._compute(op, compute, inputs)]
        return self._compute(op, compute, inputs)

    def _compute(self, op, compute, inputs):
        scales = self.scales
        if op.id in self.activated:
            return list(inputs)  # applied to a transposed convolution's phases (`_phases`)
        for i, source, target in self.shared_reads.get(op.id, ()):
            with jax.named_scope(f"{op.operands[i].edge}/shared_scale"):
                inputs[i] = fake_quant_composite(separated(inputs[i], source, fake_quant_composite,
                                                           self._separator(op.operands[i].edge, target)), target)
        if (read_at := self._read_after_layout(op)) is not None:
            at = [i for i, o in enumerate(op.operands) if o.role == "input"][-1]
            with jax.named_scope(f"{op.operands[at].edge}/separated"):
                other = separated(inputs[at], read_at, fake_quant_composite,
                                  self._separator(op.operands[at].edge, read_at))
            if op.kind == "square":
                return [inputs[0] * other]
            inputs = [other if i == at else x for i, x in enumerate(inputs)]
        if op.kind == "avg_pool" and len(op.attributes.get("window", ())) == 3:  # 1-D (`_conv1d`)
            return [average_pool_as_two_dimensional(op, inputs[0], _qtype(scales, op), fake_quant_composite)]
        if op.kind == "avg_pool" and len(inputs) == 1:
            out = scales.edges.get(op.outputs[0])
            if out is not None and pool_as_depthwise(op, out.qtype):
                return [pool_as_depthwise_conv(op, inputs[0], fake_quant_composite)]
            if out is not None and pool_pads_with_zeros(op):
                return [avg_pool_padded_with_zeros(op, inputs[0])]
        if op.kind == "max_pool" and len(inputs) == 1:
            out = scales.edges.get(op.outputs[0])
            if out is not None and out.qtype == "int16" and padded_max_pool_reads_nonnegative(op, self.graph):
                return one_dimensional_as_two(lambda x: [max_pool_padded_with_zeros(op, x)], inputs)
        if op.kind == "concatenate" and len(inputs) > 1 and _qtype(scales, op) == "int16":
            return [concatenated_by_padded_sums(inputs, op.attributes["axis"], scales.edges[op.outputs[0]],
                                                fake_quant_composite)]
        if op.kind == "scatter-add" and (summed := scattered_as_sums(
                compute, inputs, _qtype(scales, op), fake_quant_composite)) is not None:
            return summed
        if (op.kind == "gather" and _qtype(scales, op) == "int16" and op.attributes.get("rows_at") is not None
                and (source := next((o for o in op.operands if o.role == "input"
                                     and o.dtype.startswith(("float", "bfloat"))), None)) is not None
                and (rows := gathered_as_one_hot(compute, inputs, self._read_at(source),
                                                 fake_quant_composite)) is not None):
            return rows  # an activation's rows: a one-hot int16 matmul
        if op.kind == "gather" and _qtype(scales, op) == "int16":  # ``table[ids]``: as mode 'fill'
            return gathered_in_fill_mode(compute, inputs)
        if op.kind == "gather" and self._quantized_table(op):
            return gathered_without_fill(compute, inputs)
        if op.kind in ("add", "sub") and len(inputs) == 2 and _qtype(scales, op) == "int16":
            shape = self.graph.edges[op.outputs[0]].shape
            if any(o.role == "input" and tuple(o.shape) != tuple(shape) for o in op.operands):
                return [added_at_one_shape(op, inputs, shape, [self._read_at(o) for o in op.operands],
                                           fake_quant_composite)]
        if op.kind == "rsqrt" and op.id in self.rsqrt_pieces and (into := self._read_at(op.operands[0])):
            return [rsqrt_in_pieces(inputs[0], into, self.rsqrt_pieces[op.id], fake_quant_composite)]
        if op.kind == "rsqrt" and op.id in self.keep_float and len(inputs) == 1 and _qtype(scales, op):
            # A zero code dequantizes to 0, and 1/sqrt(0) = inf (or, floored at a
            # tiny value, past int32), which QUANTIZE casts to the lowest code;
            # simulate clips it to the highest. Floored where 1/sqrt is the top.
            out = scales.edges[op.outputs[0]]
            top = float(np.max(out.scale)) * out.qtype.qmax
            return [jax.lax.rsqrt(jnp.maximum(inputs[0], np.float32(1.0 / (top * top))))]
        if op.kind == "div" and scales.edges.get(op.outputs[0]) is not None:
            divisor = scalar_divisor(op)
            if divisor is not None:
                # XNNPACK has no integer DIV (each one split the graph: the
                # attention's 1/sqrt(d) in transformers, hard_sigmoid's 1/6);
                # its integer MUL by the reciprocal gives the same quotient.
                return [inputs[0] * self._reciprocal(op, divisor)]
        if op.kind in ("conv", "max_pool", "avg_pool"):  # a 1-D one as 2-D (`_conv1d`)
            mark = dynamic_range_composite if op.id in self.marked_in_two_dimensions else None
            if op.attributes.get("transposed"):
                phases = annotated_phases(self, op, compute, inputs, mark, fake_quant_composite)
                if phases is not None:
                    return phases
            return one_dimensional_as_two(compute, inputs, mark)
        if op.kind == "softmax" and "permutation" in op.attributes:  # under vmap (`graph._patterns`): canonical
            return [jax.nn.softmax(jnp.transpose(inputs[0], op.attributes["permutation"]), axis=op.attributes["axis"])]
        if op.kind == "gelu" and _qtype(scales, op) == "int16" and (into := self._read_at(op.operands[0])):
            return [gelu_in_int16(inputs[0], into, fake_quant_composite)]
        if (op.kind in EXPONENTIAL_LINEAR and scales.edges.get(op.outputs[0]) is None
                and not any(isinstance(v, jax.core.Tracer) for v in inputs[1:])  # alpha: a constant
                and (form := exponential_linear(lambda x: compute(x, *inputs[1:]), inputs[0].shape)) is not None):
            return [form(inputs[0])]
        if op.kind != "gelu" or op.attributes.get("approximate", True) or len(inputs) != 1:
            return compute(*inputs)
        if scales.edges.get(op.outputs[0]) is None and any(e in scales.edges for e in op.inputs):
            # A GELU kept in float between quantized tensors: as one tfl.gelu
            # the converter would quantize it (int8 in, the next op's qtype
            # out), so it is decomposed, in erf form: litert-converter writes
            # erf as a clamped rational polynomial (MINIMUM, MAXIMUM, MUL,
            # ADD, DIV), all XNNPACK's. jax.nn.gelu's own erfc form became
            # piecewise LESS / SELECT ops XNNPACK does not run (8 per GELU,
            # each a split of the graph). Within 1.1e-6 of jax.nn.gelu for
            # every float32 input (tests/litert/test_export.py).
            return [gelu_erf(inputs[0])]
        # jax.nn.gelu(approximate=False) is recognised only as a composite: its
        # erfc is expanded into a polynomial before the converter could match
        # GELU. `approximate` must be present (a numpy bool: jax drops a plain
        # False): litert-converter 0.5.0 crashes on a ``tfl.gelu`` without it.
        gelu = jax.lax.composite(lambda x, **_: compute(x)[0], name="tfl.gelu")
        return [gelu(inputs[0], approximate=np.bool_(False))]


def _qtype(scales: Scales, op) -> str | None:
    return None if (out := scales.edges.get(op.outputs[0])) is None else str(out.qtype)
