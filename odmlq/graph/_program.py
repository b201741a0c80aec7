"""The evaluable program of a traced model: steps, ops' hooks, and how to run them.

Internal. `_trace` builds it from a jaxpr and `_grouping` names its ops and
edges; `Graph.evaluate` runs it (see its docstring for the hooks).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from odmlq.errors import TraceError
from odmlq.graph._params import params_tree


@dataclasses.dataclass(frozen=True, eq=False)
class _Lit:
    """A literal operand of an equation. Equal and hashed by dtype, shape and bytes:
    jax 0.10 gives a literal such as the 1.0 of ``1.0 / x`` as a TypedNdArray,
    which numpy arrays' rules leave unhashable."""

    value: Any

    def _key(self) -> tuple:
        v = np.asarray(self.value)
        return v.dtype.str, v.shape, v.tobytes()

    def __eq__(self, other) -> bool:
        return isinstance(other, _Lit) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


@dataclasses.dataclass
class _Step:
    eqn: Any
    ins: list
    outs: list[int]
    stack: str = ""
    kind: str = ""
    einsum: str | None = None
    fn: Any = None  # evaluates a named call as one op


@dataclasses.dataclass
class _Region:
    """A `scan`: its body program and how outer values map into it."""

    eqn: Any
    ins: list
    outs: list[int]
    body: "_Program"
    stack: str = ""
    kind: str = "scan"


@dataclasses.dataclass
class _OpRec:
    kind: str
    stack: str
    steps: list
    einsum: str | None = None
    region: "_OpRec | None" = None
    id: str = ""
    module_path: str = ""
    attributes: dict = dataclasses.field(default_factory=dict)
    fused: bool = False  # a pattern of several primitives (see _patterns)


@dataclasses.dataclass(frozen=True)
class _Hooks:
    """What `Graph.evaluate` lets a caller observe or replace (see its docstring)."""

    on_edge: Any = None
    on_constant: Any = None
    on_op: Any = None
    on_stack: Any = None
    # Run every step whose operands are all concrete now, also under a trace
    # (`Graph.evaluate`'s `constant_steps`).
    constant_steps: bool = False


@dataclasses.dataclass
class _OpSteps:
    """One op's steps (in program order), its operands (value ids, or `_Lit`s: the
    op's `Operand`s in order) and its outputs (value ids, the op's output edges)."""

    op_id: str
    steps: list
    ins: list
    outs: list[int]


@dataclasses.dataclass
class _Program:
    invars: list[int]
    steps: list  # _Step | _Region, in order
    outvars: list
    edge_of: dict[int, str] = dataclasses.field(default_factory=dict)
    alias: set = dataclasses.field(default_factory=set)
    op_of: dict[int, str] = dataclasses.field(default_factory=dict)  # id(step) -> op id
    # (id(step), input position) -> (op id, index among the op's constant operands)
    constant_of: dict[tuple[int, int], tuple[str, int]] = dataclasses.field(default_factory=dict)
    # id(step) -> the op it belongs to, for every step of every op but scans
    # (whose body ops are hooked one by one).
    op_steps: dict[int, _OpSteps] = dataclasses.field(default_factory=dict)
    # id(step) of the steps of no op that compute from parameters alone.
    from_params: set = dataclasses.field(default_factory=set)

    def run_flat(self, values: list, hooks: _Hooks) -> list:
        env: dict[int, Any] = {}
        for v, x in zip(self.invars, values):
            env[v] = self._hook(v, x, hooks.on_edge)
        for step in self.steps:
            op = self.op_steps.get(id(step)) if hooks.on_op is not None else None
            if op is None:
                self._run_step(step, env, hooks)
                continue
            # An op runs as one at its last step: its steps are contiguous among
            # the activation steps, and the weight-only steps between them (a
            # bias reshape) read no activation, so they have run by then.
            if step is not op.steps[-1]:
                continue
            with jax.named_scope(op.op_id):
                outs = hooks.on_op(op.op_id, self._compute(op, hooks),
                                   *[r.value if isinstance(r, _Lit) else env[r] for r in op.ins])
            for v, x in zip(op.outs, outs):
                env[v] = self._hook(v, x, hooks.on_edge)
        return [r.value if isinstance(r, _Lit) else env[r] for r in self.outvars]

    def _run_step(self, step, env: dict, hooks: _Hooks, scoped: bool = True) -> None:
        ins = [r.value if isinstance(r, _Lit) else env[r] for r in step.ins]
        replaced = self._constants(step, ins, hooks.on_constant)
        # Lowered ops carry their op id as their location, so the tensors of
        # an exported model can be traced back to the plan (inside `on_op` the
        # op's own scope is already open).
        scope = self.op_of.get(id(step), "weights") if scoped else None
        # A step of no op that computes from parameters, given concrete
        # values (even while a caller traces the model: a converter, a jit
        # closing over the weights), is computed now, so what it derives from
        # the weights (an embedding gathered at constant positions) reaches
        # the trace as a constant, as it would reach a compiler that folds
        # constants; LiteRT's converter folds few of them (a gather's bounds
        # check stays as float ops). Steps on literals alone are left to the
        # converter, which matches some of them (an average pool's counts).
        eager = ((hooks.constant_steps or (scoped and id(step) in self.from_params and id(step) not in self.op_of))
                 and not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(ins)))
        with (jax.ensure_compile_time_eval() if eager else contextlib.nullcontext()), \
                (jax.named_scope(scope) if scope else contextlib.nullcontext()):
            if isinstance(step, _Region):
                stacked = step.outs[step.eqn.params["num_carry"]:]
                outs = _run_scan(step, ins, hooks, [self.edge_of.get(v) for v in stacked])
            elif step.fn is not None:
                outs = step.fn(*ins)
            elif replaced:
                # A literal lives in the equation itself: apply the primitive
                # to the replaced values instead.
                outs = step.eqn.primitive.bind(*ins, **step.eqn.params)
                outs = outs if step.eqn.primitive.multiple_results else [outs]
            else:
                outs = _eval_eqn(step.eqn, ins)
        for v, x in zip(step.outs, outs):
            env[v] = self._hook(v, x, hooks.on_edge)

    def _compute(self, op: _OpSteps, hooks: _Hooks):
        """The op as a function of its operands (no edges inside it to hook)."""
        inner = _Hooks(on_constant=hooks.on_constant, constant_steps=hooks.constant_steps)

        def compute(*xs):
            # A literal operand is read from its step (replace it with on_constant).
            env = {r: x for r, x in zip(op.ins, xs) if not isinstance(r, _Lit)}
            for step in op.steps:
                self._run_step(step, env, inner, scoped=False)
            return [env[v] for v in op.outs]

        return compute

    def _constants(self, step, ins: list, on_constant) -> bool:
        """Lets `on_constant(op_id, index, value)` replace the step's constant operands."""
        if on_constant is None or isinstance(step, _Region):
            return False
        replaced = False
        for pos in range(len(ins)):
            key = self.constant_of.get((id(step), pos))
            if key is not None:
                new = on_constant(key[0], key[1], ins[pos])
                replaced = replaced or new is not ins[pos]
                ins[pos] = new
        return replaced

    def _hook(self, v: int, x: Any, on_edge):
        if on_edge is None or v not in self.edge_of or v in self.alias:
            return x
        return on_edge(self.edge_of[v], x)


@dataclasses.dataclass
class _TopProgram:
    body: _Program
    in_tree: Any
    out_tree: Any
    num_params: int

    def run(self, params, inputs, hooks: _Hooks):
        params = params_tree(params)
        leaves, tree = jax.tree_util.tree_flatten((params, *inputs))
        if tree != self.in_tree:
            raise TraceError(
                "The params and inputs passed to evaluate() do not have the structure the "
                f"model was traced with.\n  traced: {self.in_tree}\n  given:  {tree}"
            )
        outs = self.body.run_flat(leaves, hooks)
        return jax.tree_util.tree_unflatten(self.out_tree, outs)


def _eval_eqn(eqn, ins: list) -> list:
    # A one-equation jaxpr evaluated by JAX itself: the public way to apply an
    # equation, whatever its parameters.
    invars = [a for a in eqn.invars if not isinstance(a, jcore.Literal)]
    args = [x for a, x in zip(eqn.invars, ins) if not isinstance(a, jcore.Literal)]
    # Drop the model's own name stack: the op id scope around this call names
    # the lowered op, and Linen's module names would only repeat it.
    stack = eqn.source_info.name_stack
    eqn = eqn.replace(source_info=eqn.source_info.replace(name_stack=type(stack)()))
    info = jcore.DebugInfo("odmlq", eqn.primitive.name, tuple(f"x{i}" for i in range(len(invars))),
                           tuple(f"y{i}" for i in range(len(eqn.outvars))))
    jaxpr = jcore.Jaxpr(constvars=[], invars=invars, outvars=list(eqn.outvars), eqns=[eqn],
                        effects=eqn.effects, debug_info=info)
    return jax.core.eval_jaxpr(jaxpr, [], *args, propagate_source_info=False)


def _inline_call(closed):
    # Evaluated inline (not as a nested call) so its ops take the current scope.
    def call(*args):
        return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args, propagate_source_info=False)

    return call


# The scope of an unrolled loop's step i: ``step_<i>``.
STEP_SCOPE = "step_"


def _run_scan(region: _Region, ins: list, hooks: _Hooks, stacked_edges=()) -> list:
    """A scan, unrolled when hooks watch it: a hook may keep the values it is
    given (calibration statistics, captured edges), and a value kept from
    inside `lax.scan`'s body would be a tracer that escapes it. Unrolled, each
    iteration's edges reach the hooks as values of the caller's own trace.
    `stacked_edges`: the edge of each per-step output (None where it has
    none), for ``hooks.on_stack``."""
    p = region.eqn.params
    nc, ncarry = p["num_consts"], p["num_carry"]
    consts, init, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]

    def body(carry, x):
        outs = region.body.run_flat([*consts, *carry, *x], hooks)
        return outs[:ncarry], outs[ncarry:]

    if hooks.on_edge is None and hooks.on_op is None:
        carry, ys = lax.scan(body, list(init), list(xs), length=p["length"],
                             reverse=p["reverse"], unroll=p["unroll"])
        return [*carry, *ys]
    carry, steps = list(init), []
    order = range(p["length"] - 1, -1, -1) if p["reverse"] else range(p["length"])
    for i in order:
        # Each step's ops in a scope of their own: a converted file names its tensors by step.
        with jax.named_scope(f"{STEP_SCOPE}{i}"):
            carry, y = body(carry, [x[i] for x in xs])
        steps.append(y)
    if p["reverse"]:
        steps.reverse()
    n_ys = len(region.eqn.outvars) - ncarry
    ys = [_stacked([step[j] for step in steps], stacked_edges[j] if j < len(stacked_edges) else None, hooks)
          for j in range(n_ys)] if steps else []
    return [*carry, *ys]


def _stacked(parts: list, edge: str | None, hooks: _Hooks):
    joined = None if hooks.on_stack is None or edge is None else hooks.on_stack(edge, parts)
    return jnp.stack(parts) if joined is None else joined


def evaluate_replacing(closed, args, replace: Mapping[int, Callable], each: Callable | None = None) -> list:
    """Evaluates a closed jaxpr (a traced op), with some equations replaced:
    ``replace[i](eqn, ins)`` -> the outputs of equation `i`; ``each(eqn,
    ins)``, where given, is asked first for every other equation's outputs
    (None: the equation as it is)."""
    jaxpr = closed.jaxpr
    env = {}

    def read(a):
        return a.val if isinstance(a, jcore.Literal) else env[a]

    for v, c in zip(jaxpr.constvars, closed.consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for i, eqn in enumerate(jaxpr.eqns):
        ins = [read(a) for a in eqn.invars]
        outs = replace[i](eqn, ins) if i in replace else None if each is None else each(eqn, ins)
        if outs is None:
            outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
            outs = outs if eqn.primitive.multiple_results else [outs]
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [read(a) for a in jaxpr.outvars]


def scattered_rows_axis(eqn) -> int | None:
    """The operand axis along which a scatter-add adds whole rows, one index
    per row (``jax.ops.segment_sum``, ``x.at[ids].add(rows)``), or None for
    any other scatter."""
    if len(eqn.invars) != 3:
        return None
    operand, indices, updates = (v.aval for v in eqn.invars)
    dn = eqn.params["dimension_numbers"]
    if (dn.operand_batching_dims or dn.scatter_indices_batching_dims or len(dn.scatter_dims_to_operand_dims) != 1
            or tuple(dn.inserted_window_dims) != tuple(dn.scatter_dims_to_operand_dims)
            or not indices.shape or indices.shape[-1] != 1):
        return None
    axis = int(dn.scatter_dims_to_operand_dims[0])
    window = tuple(d for i, d in enumerate(operand.shape) if i != axis)
    if (len(scattered_row_dims(eqn)) != indices.ndim - 1
            or tuple(updates.shape[d] for d in dn.update_window_dims) != window):
        return None
    return axis


def gathered_rows_axes(eqn) -> tuple[int, ...] | None:
    """The operand axes a gather indexes where it picks whole rows: each index
    vector names one position along those axes (sliced to one and dropped),
    every other axis is read whole (``nodes[senders]``, CLIP's
    ``x[jnp.arange(b), ids.argmax(-1)]``), batching axes (a gather under
    vmap) aside; None for any other gather."""
    if len(eqn.invars) != 2:
        return None
    shape = eqn.invars[0].aval.shape
    dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
    axes = tuple(int(a) for a in dn.start_index_map)
    batching = tuple(getattr(dn, "operand_batching_dims", ()))
    if (not axes or sorted(dn.collapsed_slice_dims) != sorted(axes)
            or any(sizes[a] != 1 for a in (*axes, *batching))
            or any(sizes[d] != shape[d] for d in range(len(shape)) if d not in (*axes, *batching))):
        return None
    return axes


def scattered_row_dims(eqn) -> list[int]:
    """The axes of a scatter's updates that run over its indices (the rest are windows)."""
    windows = eqn.params["dimension_numbers"].update_window_dims
    return [d for d in range(eqn.invars[2].aval.ndim) if d not in windows]
