"""Which kernel runs each quantized matmul / convolution, and running it.

Internal. `Lowerer.on_op` is the `Graph.evaluate` hook of the XLA backend: an
op of kind dot_general, conv or einsum whose weight the plan quantizes is
traced (``jax.make_jaxpr`` of the op), and its one matmul or convolution that
reads the weight is replaced by a kernel of `odmlq.xla._matmul` or `_conv`; the rest of the
op (a bias add, an einsum's transposes) runs as traced. The kernel follows
from the plan alone:

| input edge spec | weight | kernel |
|---|---|---|
| none (float) | any | weight-only: blocked dequantize + float32 matmul |
| static or dynamic int8 | int8 / int4, symmetric | int8 x int8 -> int32, one rescale |
| static or dynamic fp8 | any | fp8 activation values x dequantized weight, float32 |

Anything else (a qtype XLA does not run natively: nf4, int2..7, int16; a
scale along a contracted axis; a weight reshaped before the op) is
*emulated*: computed in float32 on the dequantized values, which equals
`simulate`, and listed as emulated with the reason in `Lowering`.

An input the op reads through a conversion (`Plan.conversions`: an int16 op
reading an int8 edge, an int8 op reading the float output of a skipped op) is
read at the conversion's scale, as `simulate` reads it: fake-quantized before
the op runs, and, where the row above picks a kernel, it is the conversion's
spec that picks it (an int8 op reading a float or int16 edge runs the int8
kernel on codes of the conversion's scale, which also rescales its int32 sums).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from odmlq.qarray import kernels as qkernels
from odmlq.errors import PlanError
from odmlq.graph import MATMUL_KINDS, evaluate_replacing
from odmlq.plan import dynamic_kernel_inputs
from odmlq.hooks import dynamic_quantize
from odmlq.qarray import QArray
from odmlq.xla import _conv, _decode, _matmul
from odmlq.xla._inputs import Input, converted_inputs

_PRIMITIVES = ("dot_general", "conv_general_dilated")


@dataclasses.dataclass(frozen=True)
class Lowering:
    """How one op runs on XLA.

    Attributes:
      op: the op id.
      schema: 'weight_only', 'static' or 'dynamic'.
      kernel: what computes it, e.g. ``'int8 x int8 -> int32 dot (16 blocks of 256 rows)'``.
      emulated: why it is computed in float32 on dequantized values (None: native).
    """

    op: str
    schema: str
    kernel: str
    emulated: str | None = None

    def __str__(self) -> str:
        return f"{self.kernel}" + (f" [emulated: {self.emulated}]" if self.emulated else "")


def quantized_weight(plan, op) -> tuple[int, str] | None:
    """(operand index, param path) of the op's quantized weight, if it has exactly one."""
    specs = {w.param for w in plan.ops[op.id].weights if w.role == "weight" and w.spec is not None}
    found = [(i, o.param) for i, o in enumerate(op.operands) if o.role == "weight" and o.param in specs]
    return found[0] if op.kind in MATMUL_KINDS and len(found) == 1 else None


class Lowerer:
    """The `on_op` hook for one evaluation (weights and scales bound).

    Args:
      converted: `odmlq.xla._inputs.converted_inputs(plan, scales)` (computed
        here when None).
    """

    def __init__(self, graph, plan, scales, weights: Mapping[str, QArray], records: dict,
                 converted: Mapping[str, Mapping[int, Input]] | None = None):
        self.ops = {op.id: op for op in graph.ops}
        self.plan, self.scales, self.weights, self.records = plan, scales, weights, records
        self.converted = converted_inputs(plan, scales) if converted is None else converted
        self.dynamic = dynamic_kernel_inputs(plan, scales.int8_outputs)

    def on_op(self, op_id: str, compute: Callable, *operands):
        op = self.ops[op_id]
        # Converted inputs arrive on the conversion's grid (`odmlq.hooks`); an
        # integer kernel below quantizes them again at that scale, which gives
        # the same codes (rounding a value on the grid returns it).
        converted = self.converted.get(op_id, {})
        found = quantized_weight(self.plan, op)
        if found is None:
            return compute(*operands)
        w_index, path = found
        closed = jax.make_jaxpr(compute)(*operands)
        invars = closed.jaxpr.invars
        anchors = [i for i, e in enumerate(closed.jaxpr.eqns)
                   if e.primitive.name in _PRIMITIVES and invars[w_index] in e.invars[:2]]
        if len(anchors) != 1:
            read = next(iter(self._quantized_inputs(op, converted)), None)
            return self._emulate(op, path, compute, operands, "the weight is read by other than one matmul", read)
        eqn = closed.jaxpr.eqns[anchors[0]]
        side = eqn.invars.index(invars[w_index])
        x_var = eqn.invars[1 - side]
        x_index = invars.index(x_var) if x_var in invars else None
        if x_index is not None and op.operands[x_index].role == "input":
            read = self._input(op, x_index, converted)
        else:
            read = next(iter(self._quantized_inputs(op, converted)), None)
            if read is not None:
                return self._emulate(op, path, compute, operands,
                                     "the quantized input is transformed inside the op before the matmul", read)
        kernel = self._kernel(op, path, eqn, side, operands[w_index], read)
        if isinstance(kernel, str):
            return self._emulate(op, path, compute, operands, kernel, read)
        return evaluate_replacing(closed, operands, {anchors[0]: kernel})

    def _input(self, op, index: int, converted: Mapping[int, Input]) -> Input | None:
        """How the op reads operand `index`: through a conversion, at its edge's
        spec, or in float (None)."""
        if index in converted:
            return converted[index]
        edge = op.operands[index].edge
        dynamic = dict(self.dynamic.get(op.id, ()))
        if index in dynamic:  # a dynamic edge, or a float one its rule has the kernel quantize
            return Input(edge=edge, spec=dynamic[index], scale=None)
        spec = self.plan.edges[edge].spec
        if spec is None:
            return None
        return Input(edge=edge, spec=spec, scale=None if spec.dynamic else self.scales.edges.get(edge))

    def _quantized_inputs(self, op, converted):
        for index, operand in enumerate(op.operands):
            if operand.role == "input" and operand.edge is not None:
                read = self._input(op, index, converted)
                if read is not None:
                    yield read

    # -- choosing ---------------------------------------------------------
    def _kernel(self, op, path, eqn, side, w_value, read: Input | None):
        """A replacement for the anchor equation, or why there is none (a str)."""
        q = self.weights[path]
        operand = op.operands[[o.param for o in op.operands].index(path)]
        if operand.stacked_axes:
            return "a stacked weight (nn.scan), sliced per iteration: not lowered yet"
        transposed = (eqn.primitive.name == "dot_general" and q.ndim == 2
                      and tuple(w_value.shape) == tuple(q.shape[::-1]) and operand.contraction_axes is not None)
        if tuple(w_value.shape) != tuple(q.shape) and not transposed:
            return f"the weight is reshaped to {tuple(w_value.shape)} before the op"
        spec = None if read is None else read.spec
        if spec is not None and not spec.dynamic and read.scale is None:
            # compute_scales gives every static edge a scale: these were made otherwise.
            raise PlanError(f"Op {op.id!r} reads static edge {read.edge!r} ({spec.describe()}) but the "
                            "scales have none for it; compute them for this plan: "
                            "odmlq.compute_scales(plan, calibration, params).")
        schema = "weight_only" if spec is None else "dynamic" if spec.dynamic else "static"
        if transposed:
            layout = _matmul.DotLayout.of(eqn.params["dimension_numbers"], side,
                                          eqn.invars[1 - side].aval.shape, w_value.shape)
            if layout is not None and layout.w_perm == (0, 1) and tuple(operand.contraction_axes) == (1,):
                return self._dot_transposed(op, q, eqn, side, read, schema, layout)
        if eqn.primitive.name == "dot_general":
            return self._dot(op, q, operand, eqn, side, read, schema)
        return self._conv(op, q, operand, eqn, side, read, schema)

    def _record(self, op, schema, kernel, emulated=None):
        self.records[op.id] = Lowering(op=op.id, schema=schema, kernel=kernel, emulated=emulated)

    def _dot(self, op, q, operand, eqn, side, read, schema):
        x_shape = eqn.invars[1 - side].aval.shape
        layout = _matmul.DotLayout.of(eqn.params["dimension_numbers"], side, x_shape, q.shape)
        if layout is None:
            return "a matmul with batch dimensions"
        contraction = tuple(layout.w_perm[:len(layout.w_perm) - len(layout.w_free)])
        if operand.contraction_axes is not None and tuple(sorted(contraction)) != tuple(operand.contraction_axes):
            return "the weight is transposed before the op"
        integer = read is not None and read.spec.qtype.kind == "int"
        w = _matmul.matrix_weight(q, layout, decoded=not integer)
        if w is None:
            return "the weight scale varies along several contracted axes"
        blocks = f"{w.blocks} block{'s' if w.blocks > 1 else ''} of {w.rows} rows"
        moved = ", unpacked/transposed per call" if w.moved else ""
        native_w = q.qtype.runs_natively_on("xla")
        out_dtype = eqn.outvars[0].aval.dtype
        if read is None:
            self._record(op, schema, f"{q.qtype} weight-only dot: decode per block, f32 dot, scale ({blocks}{moved})",
                         None if native_w else f"{q.qtype} is not native on XLA")
            return lambda e, ins: [
                layout.output(_matmul.dot_float(layout.x_matrix(ins[1 - side]), w)).astype(out_dtype)]
        spec, ts = read.spec, read.scale
        act = spec.qtype
        if act.kind == "int" and not (act.runs_natively_on("xla") and act.bits <= 8):
            return f"{act.name} activations are not native on XLA"
        if act.kind == "int" and not (q.qtype_info.kind == "int" and q.qtype_info.bits <= 8 and native_w):
            return f"an integer matmul needs int8/int4 weights, not {q.qtype}"
        if act.kind == "int" and not q.symmetric:
            return "an integer matmul needs symmetric weights"

        def kernel(e, ins):
            x = ins[1 - side]
            codes, scale, zero_point = _quantize_activation(x, spec, ts)
            s_rows = layout.x_rows(scale, x.ndim)
            if act.kind == "int":  # the input's scale applied inside, in simulate's order
                y = _matmul.dot_int(layout.x_matrix(codes), layout.x_rows(zero_point, x.ndim), w, s_rows)
                return [layout.output(y).astype(out_dtype)]
            y = _matmul.dot_float(layout.x_matrix(_decode.fp8_to_float32(codes)), w)
            return [layout.output(y * s_rows).astype(out_dtype)]

        if not _rows_only(spec, layout):
            return "the activation scale varies along a contracted axis"
        name = ("int8 x int8 -> int32 dot, one rescale" if act.kind == "int"
                else f"{act.name} activation x dequantized weight, f32 dot")
        self._record(op, schema, f"{name} ({q.qtype} weight, {blocks}{moved}{read.describe()})",
                     None if native_w else f"{q.qtype} is not native on XLA")
        return kernel

    def _dot_transposed(self, op, q, eqn, side, read, schema, layout):
        """A 2-D weight stored (N, K) and read transposed (a tied embedding as
        the output projection): whole stored rows per block (`_matmul.dot_rows`)."""
        if q.qtype_info.kind != "int" or q.qtype_info.values_per_byte != 1 or q.zero_point is not None:
            return f"the weight is transposed before the op (lowered for symmetric int8 only, not {q!r})"
        if q.block_axis is not None or q.scale.shape[1] != 1:
            return "the weight is transposed before the op and its scale varies along the contracted axis"
        spec = None if read is None else read.spec
        out_dtype = eqn.outvars[0].aval.dtype
        codes, scale = q.qvalue.reshape(q.shape), q.scale
        if spec is None:
            self._record(op, schema, f"{q.qtype} weight-only dot on the weight as stored (N, K): "
                                     "f32 dot per block of its rows, scale")
            return lambda e, ins: [layout.output(
                _matmul.dot_rows(layout.x_matrix(ins[1 - side]).astype(jnp.float32), codes, scale)).astype(out_dtype)]
        act = spec.qtype
        if not (act.kind == "int" and act.runs_natively_on("xla") and act.bits <= 8):
            return f"the weight is transposed before the op ({act.name} activations are lowered for int8 only)"
        if not _rows_only(spec, layout):
            return "the activation scale varies along a contracted axis"
        ts = read.scale

        def kernel(e, ins):
            x = ins[1 - side]
            xq, s_x, zero_point = _quantize_activation(x, spec, ts)
            y = _matmul.dot_rows(layout.x_matrix(xq), codes, scale, layout.x_rows(zero_point, x.ndim),
                                 x_scale=layout.x_rows(s_x, x.ndim))
            return [layout.output(y).astype(out_dtype)]

        self._record(op, schema, f"int8 x int8 -> int32 dot on the weight as stored (N, K), one rescale"
                                 f"{read.describe()}")
        return kernel

    def _conv(self, op, q, operand, eqn, side, read, schema):
        params = eqn.params
        dn = params["dimension_numbers"]
        out_dtype = eqn.outvars[0].aval.dtype
        if side != 1:
            return "the weight is the convolution's input"
        if operand.contraction_axes is not None and (dn.rhs_spec[1],) != tuple(operand.contraction_axes):
            return "the weight is transposed before the op"
        native_w = q.qtype.runs_natively_on("xla")
        if read is None:
            self._record(op, schema, f"{q.qtype} weight-only conv: kernel dequantized in one fused pass",
                         None if native_w else f"{q.qtype} is not native on XLA")
            return lambda e, ins: [_conv.conv_float(ins[0], q, params).astype(out_dtype)]
        spec, ts = read.spec, read.scale
        act = spec.qtype
        if act.kind != "int" or not act.runs_natively_on("xla") or act.bits > 8:
            return f"no native {act.name}-activation convolution on XLA"
        if not (q.qtype_info.kind == "int" and q.qtype_info.bits <= 8 and native_w and q.symmetric):
            return f"an integer convolution needs symmetric int8/int4 weights, not {q!r}"
        if _conv.weight_scale_axis(q) not in (-1, dn.rhs_spec[0]):
            return "the weight scale is not per output channel"
        if any(d != 1 for d in params["lhs_dilation"]) or params["batch_group_count"] != 1:
            return "a dilated-input or batch-grouped convolution"
        pixels = op.attributes.get("pointwise")  # a 1x1 convolution: a range per pixel rescales its own output
        per_pixel = pixels is not None and bool(spec.scale_axes) and pixels not in spec.scale_axes
        if any(a != dn.lhs_spec[0] for a in spec.scale_axes) and not per_pixel:
            return "the activation scale varies along other than the batch axis"

        def kernel(e, ins):
            x = ins[0]
            codes, scale, zero_point = _quantize_activation(x, spec, ts)
            y = _conv.conv_int(codes, zero_point, q, params)
            rescale = _conv.output_layout(scale, dn) if per_pixel else _batch_param(scale, dn, y.ndim)
            return [(y * rescale).astype(out_dtype)]

        self._record(op, schema, f"int8 x {q.qtype} -> int32 conv, one rescale{read.describe()}")
        return kernel

    def _emulate(self, op, path, compute, operands, reason: str, read: Input | None = None):
        """The op as traced, on the dequantized weight (the float view holds it)
        and the fake-quantized input (static edges and converted inputs already are)."""
        spec = None if read is None else read.spec
        schema = "weight_only" if spec is None else "dynamic" if spec.dynamic else "static"
        conversion = "" if read is None else read.describe().replace(";", ",")
        self._record(op, schema, f"float32 op on dequantized {self.weights[path].qtype} weight{conversion}", reason)
        if spec is not None and spec.dynamic:
            operands = [dynamic_fake_quant(x, spec) if o.role == "input" and o.edge is not None
                        and self.plan.edges[o.edge].spec == spec else x
                        for o, x in zip(op.operands, operands)]
        return compute(*operands)


def _rows_only(spec, layout: _matmul.DotLayout) -> bool:
    """Whether an activation's scale varies only along rows (free axes), so it
    can multiply the integer sums."""
    free = set(layout.x_perm[:len(layout.x_free)])
    return all(a in free for a in spec.scale_axes)


def _batch_param(p, dn, ndim: int):
    """A per-tensor or per-batch keepdims scale in the conv output's layout."""
    flat = jnp.reshape(p, (-1,))
    shape = [1] * ndim
    shape[dn.out_spec[0]] = flat.shape[0]
    return flat.reshape(shape)


def _quantize_activation(x, spec, ts):
    """``(codes, scale, zero_point)`` of an input edge: its calibrated `TensorScale`
    (static) or its own range (dynamic), as `simulate` computes them."""
    if spec.dynamic:
        return dynamic_quantize(x.astype(jnp.float32), spec)
    scale = jnp.asarray(ts.scale)
    zero_point = None if ts.zero_point is None else jnp.asarray(ts.zero_point)
    qt = spec.qtype
    codes = qkernels.quantize_values(x, scale, zero_point, qkernels.qrange(qt, False),
                                     qkernels.kernel_for(qt), None, None)
    return codes, scale, zero_point


def dynamic_fake_quant(x, spec):
    """What `simulate` makes of a dynamically quantized edge."""
    codes, scale, zero_point = _quantize_activation(x, spec, None)
    qt = spec.qtype
    values = qkernels.dequantize_values(codes, scale, zero_point, qkernels.kernel_for(qt), None, None)
    return values.astype(x.dtype)
