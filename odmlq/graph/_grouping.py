"""Groups traced steps into ops, names them, and lays out edges (internal; graph.py: the result)."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import numpy as np

from odmlq.graph import _patterns
from odmlq.graph._program import (_Lit, _OpSteps, _OpRec, _Program, _Region, _Step, gathered_rows_axes,
                                  scattered_rows_axis)
from odmlq.graph._walk import _map_axes, _Walker
from odmlq.graph._linear import pointwise, transposed_by_phases
from odmlq.graph._loops import _LoopLayout
from odmlq.graph._graph import MATMUL_KINDS, MAX_CONSTANT_SIZE, Edge, Op, Operand
from odmlq.graph._params import NNX_SCOPE

# The name scope Flax opens for a Linen method other than __call__: 'Class.method'
# (the top module's), 'name.method' (a submodule's).
_METHOD_SCOPE = re.compile(r"([A-Za-z_]\w*)\.[A-Za-z_]\w*")


@dataclasses.dataclass
class GraphParts:
    ops: tuple[Op, ...]
    edges: dict[str, Edge]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def build(walker: _Walker, top: _Program, num_params: int, framework: str) -> GraphParts:
    b = _Builder(walker, framework)
    b.count_uses(top)
    records = b.records(top, region=None)
    inputs = []
    for i, v in enumerate(top.invars[num_params:]):
        b.add_edge(top, v, f"input_{i}", producer=None, is_input=True)
        inputs.append(f"input_{i}")
    b.name_and_lay_out(top, records)
    outputs = tuple(top.edge_of[r] for r in top.outvars if not isinstance(r, _Lit) and r in top.edge_of)
    for e in outputs:
        b.edges[e] = dataclasses.replace(b.edges[e], is_output=True)
    consumers: dict[str, list[str]] = {}
    for op in b.ops:
        for edge in op.inputs:
            consumers.setdefault(edge, []).append(op.id)
    edges = {k: dataclasses.replace(e, consumers=tuple(dict.fromkeys(consumers.get(k, ()))))
             for k, e in b.edges.items()}
    return GraphParts(_name_top_level_ops(b.ops, edges), edges, tuple(inputs), outputs)


def _name_top_level_ops(ops: list[Op], edges: dict[str, Edge]) -> tuple[Op, ...]:
    """An op outside every module (a mask built from the model's inputs at its
    top level) takes the module path of the first op that reads it, so rules
    and messages can name it (its id stays as traced)."""
    by_id = {op.id: op for op in ops}
    out = list(ops)
    for i in reversed(range(len(out))):
        op = out[i]
        if op.module_path or op.kind == "scan":
            continue
        readers = [by_id[c] for e in op.outputs for c in edges[e].consumers if c in by_id]
        path = next((r.module_path for r in readers if r.module_path), "")
        if path:
            out[i] = by_id[op.id] = dataclasses.replace(op, module_path=path)
    return tuple(out)


class _Builder(_LoopLayout):
    def __init__(self, walker: _Walker, framework: str):
        self.w = walker
        self.framework = framework
        self.uses: Counter = Counter()
        self.edges: dict[str, Edge] = {}
        self.ops: list[Op] = []
        self.ids: Counter = Counter()
        self.path_of_value: dict[int, str] = {}
        self.bias_values: set[int] = set()
        # Per-channel weights of an affine epilogue (an inference BatchNorm)
        # folded into the matmul/conv before it: value id -> (step kind,
        # whether the activation is the step's first operand).
        self.fold_values: dict[int, tuple[str, bool]] = {}
        self.step_index: dict[int, dict[int, int]] = {}  # id(program) -> id(step) -> position

    # -- structure --------------------------------------------------------
    def count_uses(self, program: _Program) -> None:
        for step in program.steps:
            self.uses.update(r for r in step.ins if not isinstance(r, _Lit))
            if isinstance(step, _Region):
                self.count_uses(step.body)
        self.uses.update(r for r in program.outvars if not isinstance(r, _Lit))

    def is_activation_step(self, step) -> bool:
        return isinstance(step, _Region) or not all(self.w.is_weight(r) for r in step.ins)

    def records(self, program: _Program, region: _OpRec | None) -> list[_OpRec]:
        recs: list[_OpRec] = []
        steps = [s for s in program.steps if self.is_activation_step(s)]
        i = 0
        while i < len(steps):
            step = steps[i]
            i += 1
            pattern = _patterns.match(steps, i - 1, self.uses)
            if pattern is not None:
                window = steps[i - 1:i - 1 + len(pattern.steps)]
                recs.append(_OpRec(kind=pattern.kind, stack=step.stack, steps=window, region=region,
                                   attributes=pattern.attributes(window) if pattern.attributes else {},
                                   fused=True))
                n = len(window)
                i += n - 1
                continue
            if isinstance(step, _Region):
                rec = _OpRec(kind="scan", stack=step.stack, steps=[step], region=region)
                rec.body = self.records(step.body, rec)  # type: ignore[attr-defined]
                recs.append(rec)
                continue
            prev = recs[-1] if recs else None
            if prev is not None and self.joins_einsum(prev, step):
                prev.steps.append(step)
                continue
            if prev is not None and self.is_affine_epilogue(prev, step):
                prev.steps.append(step)
                continue
            if prev is not None and self.is_bias_add(prev, step):
                prev.steps.append(step)
                continue
            if prev is not None and self.is_pool_divide(prev, step):
                prev.steps.append(step)
                prev.kind = "avg_pool"
                prev.fused = True  # a backend may lower it as one op (see litert/_annotate)
                continue
            recs.append(_OpRec(kind="einsum" if step.einsum else step.kind, stack=step.stack,
                               steps=[step], einsum=step.einsum, region=region))
        return recs

    def joins_einsum(self, prev: _OpRec, step: _Step) -> bool:
        if not step.einsum or prev.einsum != step.einsum or prev.stack != step.stack:
            return False
        produced = {v for s in prev.steps for v in s.outs}
        if not any(r in produced for r in step.ins if not isinstance(r, _Lit)):
            return False
        has_dot = any(s.kind == "dot_general" for s in prev.steps)
        return not (step.kind == "dot_general" and has_dot)

    def is_bias_add(self, prev: _OpRec, step: _Step, dry_run: bool = False) -> bool:
        if prev.kind not in MATMUL_KINDS or step.kind != "add" or len(step.ins) != 2:
            return False
        if any(s.kind == "add" for s in prev.steps) or prev.attributes.get("fold"):
            return False
        out = prev.steps[-1].outs[0]
        a, c = step.ins
        other = c if a == out else a if c == out else None
        if other is None or isinstance(other, _Lit) or self.uses[out] != 1:
            return False
        w = self.w.weights.get(other)
        if w is None or not w.params:
            return False
        # A bias belongs to a matmul of a weight (its int32 scale is the input's
        # times the weight's), one value per output channel where that axis is
        # known; a product of two activations plus a parameter (a learned
        # attention bias) or a table over positions is an ADD of its own.
        if not any(not isinstance(r, _Lit) and r in self.w.weights and self.w.weights[r].params
                   for s in prev.steps for r in s.ins):
            return False
        channel = self.output_channel_axis(prev)
        shape, out_shape = tuple(self.w.avals[other].shape), tuple(self.w.avals[out].shape)
        aligned = (1,) * (len(out_shape) - len(shape)) + shape
        if channel is not None and (len(aligned) != len(out_shape)
                                    or any(d != 1 for i, d in enumerate(aligned) if i != channel)):
            return False
        if not dry_run:
            self.bias_values.add(other)
        return True

    def is_affine_epilogue(self, prev: _OpRec, step: _Step) -> bool:
        """A per-channel affine step after a matmul/conv: ``y - w``, ``y * w``,
        ``y + w`` or ``y / w`` with `w` derived from parameters and varying
        along the output channel only. Inference BatchNorm traces as such a
        chain (sub mean, mul scale * rsqrt(var + eps), add bias); it is folded
        into the op: its kernel scaled per channel, its bias shifted.

        A bias add after the matmul/conv comes first (`is_bias_add`); once an
        epilogue has begun, a further add belongs to it."""
        if prev.kind not in ("dot_general", "conv") or step.kind not in ("add", "sub", "mul", "div"):
            return False
        if len(step.ins) != 2 or (step.kind == "add" and not prev.attributes.get("fold")
                                  and not any(s.kind == "add" for s in prev.steps)
                                  and self.is_bias_add(prev, step, dry_run=True)):
            return False
        out = prev.steps[-1].outs[0]
        a, c = step.ins
        if a == out:
            other, first = c, True
        elif c == out and step.kind in ("add", "mul"):
            other, first = a, False
        else:
            return False
        if isinstance(other, _Lit) or self.uses[out] != 1:
            return False
        w = self.w.weights.get(other)
        channel = self.output_channel_axis(prev)
        if w is None or not w.params or channel is None:
            return False
        shape, out_shape = tuple(self.w.avals[other].shape), tuple(self.w.avals[out].shape)
        aligned = (1,) * (len(out_shape) - len(shape)) + shape
        if len(aligned) != len(out_shape) or any(d != 1 for i, d in enumerate(aligned) if i != channel):
            return False
        self.fold_values[other] = (step.kind, first)
        prev.attributes["fold"] = True
        return True

    def output_channel_axis(self, rec: _OpRec) -> int | None:
        """The output axis a matmul/conv's weight's output channels run along."""
        anchor = rec.steps[0]
        if anchor.eqn is None:
            return None
        ndim = len(anchor.eqn.outvars[0].aval.shape)
        if anchor.kind == "conv":
            return int(anchor.eqn.params["dimension_numbers"].out_spec[1])
        weight_free = [i for i, r in enumerate(anchor.ins[:2])
                       if not isinstance(r, _Lit) and self.w.weights.get(r) is not None
                       and self.w.weights[r].params]
        if weight_free != [1]:
            return None
        (_, rc), (_, rb) = anchor.eqn.params["dimension_numbers"]
        rhs_ndim = len(anchor.eqn.invars[1].aval.shape)
        free = [a for a in range(rhs_ndim) if a not in rc and a not in rb]
        return ndim - 1 if len(free) == 1 else None

    def is_pool_divide(self, prev: _OpRec, step: _Step) -> bool:
        """A window sum divided by a constant (the window size) is an average pool."""
        if prev.kind != "reduce_window_sum" or step.kind != "div" or len(prev.steps) != 1:
            return False
        out = prev.steps[0].outs[0]
        numerator, denominator = step.ins
        return numerator == out and self.uses[out] == 1 and self.w.is_weight(denominator)

    # -- names, edges, operands -------------------------------------------
    def module_path(self, rec: _OpRec) -> str:
        path = stack_module_path(rec.stack, self.framework)
        if path:
            return path
        for r in self.external_ins(rec):
            w = self.w.weights.get(r)
            if w is not None and w.params:
                return w.params[0].rpartition("/")[0]
        for r in self.external_ins(rec):
            if r in self.path_of_value:
                return self.path_of_value[r]
        return ""

    def external_ins(self, rec: _OpRec) -> list[int]:
        produced: set[int] = set()
        out: list[int] = []
        for step in rec.steps:
            for r in step.ins:
                if not isinstance(r, _Lit) and r not in produced and r not in out:
                    out.append(r)
            produced.update(step.outs)
        return out

    def rec_outputs(self, rec: _OpRec, program: _Program) -> list[int]:
        if rec.kind == "scan":
            return list(rec.steps[0].outs)
        inside = Counter(r for s in rec.steps for r in s.ins if not isinstance(r, _Lit))
        program_outs = {r for r in program.outvars if not isinstance(r, _Lit)}
        outs = [v for s in rec.steps for v in s.outs
                if self.uses[v] > inside[v] or v in program_outs]
        return outs or list(rec.steps[-1].outs)

    def add_edge(self, program, v, edge_id, producer, is_input=False, alias=None):
        aval = self.w.avals[v]
        self.edges[edge_id] = Edge(
            id=edge_id, shape=tuple(int(d) for d in aval.shape), dtype=str(aval.dtype),
            producer=producer, is_input=is_input, alias=alias,
        )
        program.edge_of[v] = edge_id
        if alias is not None:
            program.alias.add(v)

    def new_id(self, path: str, kind: str) -> str:
        base = f"{path}/{kind}" if path else kind
        n = self.ids[base]
        self.ids[base] += 1
        return base if n == 0 else f"{base}_{n}"

    def name_and_lay_out(self, program: _Program, recs: list[_OpRec]) -> None:
        for rec in recs:
            if rec.kind == "scan":
                self.lay_out_scan(program, rec)
                continue
            rec.module_path = self.module_path(rec)
            rec.id = self.new_id(rec.module_path, rec.kind)
            for step in rec.steps:
                program.op_of[id(step)] = rec.id
            outs = self.rec_outputs(rec, program)
            names = [rec.id] if len(outs) == 1 else [f"{rec.id}:{i}" for i in range(len(outs))]
            for v, name in zip(outs, names):
                self.add_edge(program, v, name, producer=rec.id)
                self.path_of_value[v] = rec.module_path
            self.ops.append(self.make_op(rec, program, names))
            self.register_op(rec, program, outs)

    def make_op(self, rec: _OpRec, program: _Program, outputs: list[str]) -> Op:
        ins = list(rec.steps[0].ins) if rec.kind == "scan" else self.external_ins(rec)
        if len(rec.steps) == 1 and rec.kind != "scan":
            # A one-primitive op's literals are its operands (x * 0.5); in a fused
            # op (gelu, softmax) they are part of what the op computes.
            ins = list(rec.steps[0].ins)
        axes = self.weight_axes(rec) if rec.kind in MATMUL_KINDS else {}
        operands = []
        for r in ins:
            if isinstance(r, _Lit):
                value = np.asarray(r.value)
                self.register_constant(rec, program, r, len([o for o in operands if o.role == "constant"]))
                operands.append(Operand(role="constant", shape=value.shape, dtype=str(value.dtype),
                                        value=value))
                continue
            aval = self.w.avals[r]
            shape, dtype = tuple(int(d) for d in aval.shape), str(aval.dtype)
            w = self.w.weights.get(r)
            if w is None:
                edge = program.edge_of.get(r)
                # A matmul's activation: the axes it contracts (None: not traced through its layout).
                contraction = axes[r][1] if r in axes else ()
                operands.append(Operand(role="input", edge=edge, shape=shape, dtype=dtype,
                                        contraction_axes=contraction))
            elif not w.params:
                if rec.kind != "scan":
                    self.register_constant(rec, program, r, len([o for o in operands if o.role == "constant"]))
                channel, contraction = axes.get(r, ((), ()))
                operands.append(Operand(role="constant", shape=shape, dtype=dtype,
                                        channel_axes=channel, contraction_axes=contraction,
                                        value=_small(self.w.constants.get(r))))
            else:
                channel, contraction = axes.get(r, ((), ()))
                role = "bias" if r in self.bias_values else "fold" if r in self.fold_values else "weight"
                operands.append(Operand(
                    role=role, param=w.params[0],
                    shape=shape, dtype=dtype, channel_axes=channel,
                    contraction_axes=contraction, stacked_axes=w.stacked,
                    derived=w.arithmetic))
        attributes = {"einsum": rec.einsum} if rec.einsum else {}
        attributes.update(rec.attributes)
        if rec.attributes.get("fold"):
            attributes["fold"] = self.fold_description(rec, ins)
        if rec.kind == "gather":
            mode = rec.steps[0].eqn.params.get("mode")
            attributes["mode"] = getattr(mode, "name", str(mode)).lower()  # fill_or_drop, clip, ...
            gather = next((st for st in rec.steps if st.kind == "gather"), None)
            # None: not whole rows
            attributes["rows_at"] = None if gather is None else gathered_rows_axes(gather.eqn)
        if rec.kind == "scatter-add":  # None: not whole rows along one axis
            attributes["rows_along"] = scattered_rows_axis(next(st for st in rec.steps if st.kind == "scatter-add").eqn)
        if rec.kind == "concatenate":
            joined = next(st for st in rec.steps if st.kind == "concatenate")
            attributes["axis"] = int(joined.eqn.params["dimension"])
        if rec.kind == "conv":
            conv = next(st for st in rec.steps if st.kind == "conv")
            # Input dilation: a transposed convolution (nn.ConvTranspose, lax.conv_transpose).
            attributes["transposed"] = any(d != 1 for d in conv.eqn.params.get("lhs_dilation") or ())
            if attributes["transposed"]:
                attributes["transposed_by_phases"] = transposed_by_phases(conv.eqn.params)
            attributes["pointwise"] = pointwise(conv.eqn)
        if rec.kind in ("avg_pool", "max_pool"):
            window = rec.steps[0].eqn.params["window_dimensions"]
            if rec.kind == "avg_pool":
                attributes["window_size"] = int(np.prod(window))
                # Every window divided by the window size (count_include_pad,
                # Flax's default), rather than by its count of real values.
                divisor = rec.steps[-1].ins[1]
                value = divisor.value if isinstance(divisor, _Lit) else self.w.constants.get(divisor)
                attributes["counts_padding"] = bool(
                    value is not None and np.size(value) == 1
                    and float(np.asarray(value).reshape(())) == attributes["window_size"])
            params = rec.steps[0].eqn.params
            attributes["window"] = [int(w) for w in window]
            attributes["strides"] = [int(s) for s in params["window_strides"]]
            attributes["padding"] = [[int(lo), int(hi)] for lo, hi in params["padding"]]
            attributes["dilated"] = any(d != 1 for d in (*params["base_dilation"], *params["window_dilation"]))
        return Op(id=rec.id, kind=rec.kind, module_path=rec.module_path, operands=tuple(operands),
                  outputs=tuple(outputs), region=rec.region.id if rec.region else None,
                  attributes=attributes)

    def fold_description(self, rec: _OpRec, ins: list) -> dict:
        """How to read a folded affine epilogue from the op's operands: its steps
        in order as [kind, operand index, activation first], the output axis
        its per-channel weights run along, and the output's rank."""
        steps = []
        for step in rec.steps:
            for r in step.ins:
                if not isinstance(r, _Lit) and r in self.fold_values and r in ins:
                    kind, first = self.fold_values[r]
                    steps.append([kind, ins.index(r), first])
        ndim = len(self.w.avals[rec.steps[0].outs[0]].shape)
        return {"steps": steps, "channel_axis": self.output_channel_axis(rec), "ndim": ndim}

    def register_op(self, rec: _OpRec, program: _Program, outs: list[int]) -> None:
        """Lets evaluate run the op as one function (`on_op`), with its operands in
        `make_op`'s order. Its activation steps are consecutive by construction;
        only steps on weights alone may lie between them."""
        if id(program) not in self.step_index:
            self.step_index[id(program)] = {id(s): i for i, s in enumerate(program.steps)}
        index = self.step_index[id(program)]
        first, last = index[id(rec.steps[0])], index[id(rec.steps[-1])]
        own = {id(s) for s in rec.steps}
        if any(self.is_activation_step(s) and id(s) not in own for s in program.steps[first:last + 1]):
            return  # cannot happen with `records`' grouping; run step by step if it ever does
        ins = list(rec.steps[0].ins) if len(rec.steps) == 1 else self.external_ins(rec)
        op = _OpSteps(rec.id, list(rec.steps), ins, outs)
        for step in rec.steps:
            program.op_steps[id(step)] = op

    def register_constant(self, rec: _OpRec, program: _Program, r, index: int) -> None:
        """Where the op's steps read constant `r`, so evaluate can replace it there."""
        for step in rec.steps:
            for pos, used in enumerate(step.ins):
                if used is r or (not isinstance(r, _Lit) and used == r):
                    program.constant_of[(id(step), pos)] = (rec.id, index)

    def weight_axes(self, rec: _OpRec) -> dict[int, tuple]:
        """Output-channel and contraction axes of each weight, in its parameter's
        layout, and of each activation input (free and contracted axes), in its own."""
        local = {}
        for r in self.external_ins(rec):
            if isinstance(r, _Lit):
                continue
            w = self.w.weights.get(r)
            if w is not None:
                # A constant (no parameter behind it) is laid out as it is read.
                local[r] = (w.axis_map if w.axis_map is not None or w.params
                            else tuple(range(len(self.w.avals[r].shape))))
            else:
                local[r] = tuple(range(len(self.w.avals[r].shape)))
        origin = {r: r for r in local}
        found: dict[int, tuple] = {}
        for step in rec.steps:
            if step.kind in ("dot_general", "conv"):
                for pos, r in enumerate(step.ins[:2]):
                    if isinstance(r, _Lit) or r not in local:
                        continue
                    channel, contraction = _anchor_axes(step, pos)
                    am = local[r]
                    found[origin[r]] = (_through(am, channel), _through(am, contraction))
            elif len(step.ins) == 1 and step.ins[0] in local and step.eqn is not None:
                for v in step.outs:
                    local[v] = _map_axes(step.eqn, local[step.ins[0]])
                    origin[v] = origin[step.ins[0]]
        return found


def _small(value):
    return value if value is not None and np.size(value) <= MAX_CONSTANT_SIZE else None


def _through(axis_map, axes):
    if axis_map is None or any(axis_map[a] is None for a in axes):
        return None
    return tuple(sorted(axis_map[a] for a in axes))


def _anchor_axes(step: _Step, pos: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    ndim = len(step.eqn.invars[pos].aval.shape)
    if step.kind == "dot_general":
        (lc, rc), (lb, rb) = step.eqn.params["dimension_numbers"]
        contract = tuple(lc if pos == 0 else rc)
        free = tuple(a for a in range(ndim) if a not in contract)
        return free, contract
    dn = step.eqn.params["dimension_numbers"]
    if pos == 1:
        return (dn.rhs_spec[0],), (dn.rhs_spec[1],)
    return (dn.lhs_spec[1],), ()



def stack_module_path(stack: str, framework: str) -> str:
    """The module path a name stack names ('' at the top level)."""
    parts = [p for p in stack.split("/") if p and "->" not in p]
    scoped = [i for i, p in enumerate(parts) if p.startswith(NNX_SCOPE)]
    if framework == "nnx" and scoped:  # `_params.nnx_call_scopes`: the innermost module's path
        parts = parts[scoped[-1]][len(NNX_SCOPE):].split(".") + parts[scoped[-1] + 1:]
    if framework == "linen" and parts:
        # Flax names a method other than __call__ by its module:
        # 'Transformer/Transformer.encode/encoder' (the top module's),
        # 'Decoder/embedding.attend' (a submodule's). The path is the modules'.
        modules: list[str] = []
        for p in parts:
            method = _METHOD_SCOPE.fullmatch(p)
            if method is None:
                modules.append(p)
            elif not modules or modules[-1] != method.group(1):
                modules.append(method.group(1))
        parts = modules[1:]  # without the top module's name
    return "/".join(parts)
