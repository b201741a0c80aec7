"""Transposed convolutions as one CONV_2D of their phases (internal; used by `_annotate`).

A transposed convolution (``lax.conv_transpose``, ``nn.ConvTranspose``: a
convolution over its input dilated by the stride ``s``) computes output
position ``s m + r`` from the kernel taps ``t = t0(r) + s u`` alone. Each of
the ``s`` phases ``r`` (``s_h s_w`` in 2-D) is an ordinary convolution of the
undilated input with those taps; stacked along the output channels, they are
one stride-1 convolution whose output channel ``(r, c)`` holds phase ``r`` of
channel ``c``, and a reshape and transpose interleave the phases (a
depth-to-space), a slice dropping the positions past the output's end.

litert-converter 0.5.0 makes TRANSPOSE_CONV of the dilated convolution
itself, reversing its kernel with a REVERSE_V2 op: with int8 weights, a
dequantized kernel reversed at every invocation; in float, with a padding
it has no form for (a 3x3 kernel, stride 2, Flax's 'SAME'), an output of
the wrong size. The phase kernel is computed here from the weight's values
(its integers, each phase channel on its channel's scale), so the file
holds it as CONV_2D's constant filter: the same integers, the same sums per
output value, one XNNPACK-run kernel. Other ops of the op after the
convolution (a bias, a folded BatchNorm, a fused ReLU), elementwise with
per-channel operands, run on the phases before they are interleaved, so the
converter fuses them into the CONV_2D; the output is quantized there and
moved as integers.

Handled: one or two spatial axes (a 1-D one as 2-D over an axis of size
1), window stride 1, one feature group, any kernel dilation (written out as
zeros between the taps) (`odmlq.graph.transposed_by_phases`); the plan
refuses the others.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from odmlq.errors import OdmlqError
from odmlq.graph import evaluate_replacing, phase_axes, transposed_by_phases
from odmlq.litert._mapping import INPUT_LAYOUT
from odmlq.scales import TensorScale

__all__ = ["annotated_phases", "as_phases", "host_value"]

_ELEMENTWISE = frozenset({"add", "sub", "mul", "div", "max", "min", "neg"})


def as_phases(compute, inputs, weights, out_quantize, quantize_weight, mark=None):
    """The op's outputs with its transposed convolution computed by phases
    (see the module doc); None when it has none this handles.

    Args:
      weights: operand index -> the weight's host values (on its grid where
        it is quantized), for the convolution's kernel.
      out_quantize: ``x -> x`` quantized as the op's output edge (identity
        where it is float).
      quantize_weight: ``(phase kernel OHWI, the kernel's op input index,
        its output-channel axis) -> the filter``: a constant, quantized as
        the weight is (each phase channel on its channel's scale).
      mark: the dynamic-range marker, put on the laid-out input.
    """
    closed = jax.make_jaxpr(compute)(*inputs)
    jaxpr = closed.jaxpr
    convs = [i for i, e in enumerate(jaxpr.eqns)
             if e.primitive.name == "conv_general_dilated" and transposed_by_phases(e.params)]
    if len(convs) != 1:
        return None
    at = convs[0]
    rhs = _concrete(closed, jaxpr.eqns[at].invars[1], weights)
    if rhs is None:
        return None
    rhs_index = next((i for i, v in enumerate(jaxpr.invars) if v is jaxpr.eqns[at].invars[1]), None)
    if rhs_index is None:
        return None  # a kernel computed in the op: its scales are not the weight's
    layout = _Phases(jaxpr.eqns[at].params, jaxpr.eqns[at].invars[0].aval.shape, rhs.shape,
                     jaxpr.eqns[at].outvars[0].aval.shape)
    rhs = _dilated(rhs, jaxpr.eqns[at].params)

    def convolve(eqn, ins):
        return [_OnPhases(layout.convolve(ins[0], rhs, mark, quantize_weight, rhs_index))]

    def each(eqn, ins):
        if not any(isinstance(x, _OnPhases) for x in ins):
            return None
        operands = layout.lift(eqn, ins) if eqn.primitive.name in _ELEMENTWISE else None
        if operands is None:  # interleaved here: what follows reads the op's own layout
            ins = [layout.interleave(x.value) if isinstance(x, _OnPhases) else x for x in ins]
            out = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
            return out if eqn.primitive.multiple_results else [out]
        if eqn.primitive.name == "sub" and isinstance(ins[0], _OnPhases) and not isinstance(ins[1], _OnPhases):
            # As an addition, which the converter fuses into the CONV_2D (a folded
            # BatchNorm's bias arrives as a subtrahend).
            return [_OnPhases(operands[0] + (-operands[1]))]
        return [_OnPhases(eqn.primitive.bind(*operands, **eqn.params))]

    results = []
    for y in evaluate_replacing(closed, inputs, {at: convolve}, each):
        if isinstance(y, _OnPhases):
            with jax.named_scope(INPUT_LAYOUT):
                y = layout.interleave(out_quantize(y.value))
        results.append(y)
    return results


class _OnPhases:
    """A value of the op computed on the phases (not yet interleaved)."""

    def __init__(self, value):
        self.value = value


def _dilated(rhs: np.ndarray, params) -> np.ndarray:
    """The kernel with its dilation written out: zeros between its taps."""
    spec = params["dimension_numbers"].rhs_spec
    for j, d in enumerate(params["rhs_dilation"]):
        if d != 1:
            axis = spec[2 + j]
            shape = list(rhs.shape)
            shape[axis] = (shape[axis] - 1) * d + 1
            out = np.zeros(shape, rhs.dtype)
            index = [slice(None)] * rhs.ndim
            index[axis] = slice(None, None, d)
            out[tuple(index)] = rhs
            rhs = out
    return rhs


def host_value(value) -> np.ndarray | None:
    """`value` as a numpy array, or None where it is traced."""
    try:
        return np.asarray(value)
    except jax.errors.TracerArrayConversionError:
        return None


def _concrete(closed, var, values: dict) -> np.ndarray | None:
    """`var`'s value computed on the host from the op inputs in `values`
    (index -> array), or None where it depends on another input."""
    jaxpr = closed.jaxpr
    env = {v: np.asarray(c) for v, c in zip(jaxpr.constvars, closed.consts)}
    for i, v in enumerate(jaxpr.invars):
        if i in values:
            env[v] = np.asarray(values[i])
    with jax.ensure_compile_time_eval():
        for eqn in jaxpr.eqns:
            if any(not isinstance(a, jcore.Literal) and a not in env for a in eqn.invars):
                continue
            ins = [a.val if isinstance(a, jcore.Literal) else env[a] for a in eqn.invars]
            outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
            for v, o in zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]):
                env[v] = o
            if var in env:
                break
    return None if var not in env else np.asarray(env[var], np.float32)


class _Phases:
    """The geometry of one transposed convolution's phases."""

    def __init__(self, params, in_shape, kernel_shape, out_shape):
        self.lhs_spec, self.rhs_spec, self.out_spec = params["dimension_numbers"]
        self.strides = tuple(int(s) for s in params["lhs_dilation"])
        self.out_shape = tuple(int(d) for d in out_shape)
        self.sizes = tuple(int(self.out_shape[self.out_spec[2 + j]]) for j in range(len(self.strides)))
        self.count = int(np.prod(self.strides))
        # Per spatial axis: (tap index per phase and position, positions, input window).
        self.axes = phase_axes(params, in_shape, kernel_shape, out_shape)

    def convolve(self, x, rhs, mark, quantize_weight, rhs_index):
        spatial = len(self.strides)
        with jax.named_scope(INPUT_LAYOUT):
            x = jnp.transpose(x, (self.lhs_spec[0], *self.lhs_spec[2:], self.lhs_spec[1]))  # (N, spatial, C)
            for j, (_, _, (start, stop, left, right)) in enumerate(self.axes):
                x = jax.lax.slice_in_dim(x, start, stop, axis=1 + j)
                if left or right:
                    pads = [(0, 0, 0)] * x.ndim
                    pads[1 + j] = (left, right, 0)
                    x = jax.lax.pad(x, np.zeros((), x.dtype), pads)
            if spatial == 1:
                x = x[:, :, None, :]
            if mark is not None:
                x = mark(x)
        kernel = np.transpose(rhs, (*self.rhs_spec[2:], self.rhs_spec[1], self.rhs_spec[0]))  # (spatial, I, O)
        for j, (taps, _, _) in enumerate(self.axes):
            # One zero tap at the end stands for the taps a phase does not have.
            padded = np.concatenate([kernel, np.zeros_like(np.take(kernel, [0], axis=2 * j))], axis=2 * j)
            kernel = np.take(padded, taps, axis=2 * j)  # that axis becomes (phase, position)
        # (r_1, L_1, ..., I, O) -> OHWI with channel (r_1, ..., o): phases major.
        order = [2 * j for j in range(spatial)]
        positions = [2 * j + 1 for j in range(spatial)]
        n = kernel.ndim
        native = np.transpose(kernel, (*order, n - 1, *positions, n - 2))
        native = native.reshape(self.count * kernel.shape[-1], *native.shape[spatial + 1:])
        if spatial == 1:
            native = native[:, :, None, :]
        with jax.named_scope(INPUT_LAYOUT):
            filt = quantize_weight(native, rhs_index, self.rhs_spec[0])
            return jax.lax.conv_general_dilated(x, jnp.transpose(filt, (1, 2, 3, 0)), (1, 1), "VALID",
                                                dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def lift(self, eqn, ins):
        """The elementwise op's operands on the phases: those computed there as
        they are, per-channel ones repeated for every phase; None where an
        operand is neither."""
        channels = self.out_shape[self.out_spec[1]]
        rank = len(self.out_shape)
        out = []
        for value in ins:
            if isinstance(value, _OnPhases):
                out.append(value.value)
                continue
            shape = np.shape(value)
            if len(shape) == 0:
                out.append(value)
                continue
            if len(shape) != rank or any(d != 1 for i, d in enumerate(shape) if i != self.out_spec[1]):
                return None
            if shape[self.out_spec[1]] not in (1, channels):
                return None
            # A constant (a bias) repeated on the host: the converter fuses it into the CONV_2D.
            host = host_value(value)
            xp, value = (jnp, value) if host is None else (np, host)
            vector = xp.broadcast_to(xp.reshape(value, (shape[self.out_spec[1]],)), (channels,))
            out.append(xp.reshape(xp.tile(vector, self.count), (1, 1, 1, self.count * channels)))
        return out

    def interleave(self, p):
        """The phase tensor ``(N, M_1, M_2, phases * C)`` in the op's output layout."""
        with jax.named_scope(INPUT_LAYOUT):
            batch, m1, m2, _ = p.shape
            s1 = self.strides[0]
            s2 = self.strides[1] if len(self.strides) > 1 else 1
            channels = p.shape[-1] // self.count
            y = jnp.reshape(p, (batch * m1, m2, s1, s2, channels))
            y = jnp.transpose(y, (0, 2, 1, 3, 4))
            y = jnp.reshape(y, (batch, m1 * s1, m2 * s2, channels))
            y = y[:, :self.sizes[0], :(self.sizes[1] if len(self.sizes) > 1 else 1)]
            if len(self.strides) == 1:
                y = y[:, :, 0]
            canonical = (self.out_spec[0], *self.out_spec[2:], self.out_spec[1])
        return jnp.transpose(y, tuple(int(i) for i in np.argsort(canonical)))


def annotated_phases(annotation, op, compute, inputs, mark, fake_quant_composite):
    """The LiteRT materializer's (`_annotate.Annotation`) transposed convolution:
    `as_phases` with the weight's integers and scales, the op's output
    quantization (or, where the plan fuses a ReLU after it, that ReLU's,
    which then passes its input on: `Annotation.activated`), and
    `fake_quant_composite` for both."""
    weights = {}
    for i, o in enumerate(op.operands):
        if o.role == "weight" and o.param in annotation.scales.weights and annotation.grid is not None:
            weights[i] = annotation.grid(o.param)
        elif o.role == "weight" and host_value(inputs[i]) is not None:
            weights[i] = host_value(inputs[i])
    out = annotation.scales.edges.get(op.outputs[0]) if len(op.outputs) == 1 else None
    activation = None
    if out is None and len(op.outputs) == 1:
        # A ReLU the plan fuses into the convolution: applied and quantized on the
        # phases too (it changes nothing after that), so that CONV_2D reads and
        # writes integers however the phases are cropped.
        graph = annotation.graph
        readers = [graph.op(c) for c in graph.edges[graph.resolve(op.outputs[0])].consumers]
        if len(readers) == 1 and readers[0].kind in ("relu", "relu6") and len(readers[0].outputs) == 1:
            out = annotation.scales.edges.get(readers[0].outputs[0])
            if out is not None and not out.scale_axes:
                annotation.activated.add(readers[0].id)  # then the identity (`Annotation._compute`)
                if not _clamps_as(out, readers[0].kind):
                    activation = jax.nn.relu if readers[0].kind == "relu" else jax.nn.relu6

    def out_quantize(x):
        if out is None or out.scale_axes:
            return x
        return fake_quant_composite(x if activation is None else activation(x), out)

    def quantize_weight(native, index, out_axis):
        ts = annotation.scales.weights.get(op.operands[index].param)
        if ts is None:
            return jnp.asarray(native)
        if not ts.scale_axes:
            return fake_quant_composite(jnp.asarray(native), ts)
        if ts.scale_axes != (out_axis,):
            raise OdmlqError(f"Op {op.id!r}: the kernel's scales run along axis {ts.scale_axes[0]}, not "
                             f"its output channels ({out_axis}); LiteRT quantizes weights along output "
                             "channels. Quantize this weight per channel along its outputs, or per tensor.")
        scale = np.tile(np.asarray(ts.scale, np.float32).reshape(-1), native.shape[0] // np.size(ts.scale))
        zero = None if ts.zero_point is None else np.tile(
            np.asarray(ts.zero_point).reshape(-1), native.shape[0] // np.size(ts.scale)).reshape(-1, 1, 1, 1)
        phase = dataclasses.replace(ts, scale=scale.reshape(-1, 1, 1, 1), zero_point=zero, scale_axes=(0,))
        return fake_quant_composite(jnp.asarray(native), phase, 0)

    return as_phases(compute, inputs, weights, out_quantize, quantize_weight, mark)


def _clamps_as(ts: TensorScale, kind: str) -> bool:
    """Whether quantizing to `ts` alone computes the ReLU (or ReLU6) too: its
    grid starts at 0 (and, for ReLU6, ends at 6 or below). Then the converter
    writes no RELU op, which XNNPACK does not run in int8."""
    qmin, qmax = ts.qtype.range(ts.narrow_range)
    zero = 0.0 if ts.zero_point is None else float(np.asarray(ts.zero_point).reshape(()))
    scale = float(np.asarray(ts.scale).reshape(()))
    return qmin == zero and (kind == "relu" or (qmax - zero) * scale <= 6.0)
