"""Tracing: a model's jaxpr turned into a `Graph` and an evaluable program.

Internal. The public entry is `odmlq.graph.trace`. See graph.py for what the
graph contains; this module only walks jaxprs (`_program` runs them,
`_grouping` groups their steps into ops).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from odmlq.graph._program import _eval_eqn, _inline_call, _Lit, _Program, _Region, _Step

# jax.nn functions JAX keeps as named calls (`jit[name=...]`); each is one op.
# (silu and swish are not: x * sigmoid(x) is traced as its LOGISTIC and MUL,
# each an integer kernel, with the sigmoid's own edge between them; nor glu,
# its halves' LOGISTIC and MUL (as one op it stayed float). Nor is
# hard_swish (hard_silu): x * relu6(x + 3) / 6 is its ADD, RELU6, MUL by 1/6 and
# MUL. LiteRT's int8 HARD_SWISH runs outside XNNPACK and has no int16 kernel; a
# MobileNetV3-like CNN ran at 4.3x float with it and 0.6x float as those four
# integer kernels, at 0.2 dB more SQNR: bench/README.md.)
NAMED_FUNCTIONS = frozenset({
    "relu", "relu6",
    "elu", "selu", "celu", "leaky_relu", "softplus", "soft_sign",
    "log_sigmoid", "sigmoid", "gelu", "log_softmax", "softmax",
    "squareplus", "mish", "sparse_plus",
})
# jax.nn functions traced as another form of the same values: hard_tanh's
# comparisons and selects have no integer kernel (LiteRT runs them on
# dequantized values); the clip is MAXIMUM and MINIMUM.
REWRITTEN_FUNCTIONS = {"hard_tanh": lambda x: jnp.clip(x, -1.0, 1.0)}
# Primitives whose kind gets a shorter name in plans and rules.
KIND_NAMES = {"conv_general_dilated": "conv", "reduce_window_max": "max_pool"}
ANCHORS = ("dot_general", "conv_general_dilated")
_SAME_AXES = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision"})
_INLINE_CALLS = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "closed_call", "remat2",
                 "core_call", "remat", "checkpoint")


@dataclasses.dataclass(frozen=True)
class _W:
    """What a weight-derived value is: its parameters and axis mapping."""

    params: tuple[str, ...]
    axis_map: tuple[int | None, ...] | None  # value axis -> parameter axis
    stacked: tuple[int, ...] = ()
    # Computed by arithmetic (rsqrt(var + eps) * scale), not only laid out.
    arithmetic: bool = False


# Primitives that move a weight's values without computing new ones.
_LAYOUT = frozenset({"reshape", "squeeze", "broadcast_in_dim", "transpose", "convert_element_type", "copy",
                     "copy_p", "reduce_precision", "expand_dims", "slice", "dynamic_slice", "concatenate",
                     "rev", "pjit", "jit"})


def _subjaxpr(eqn, name):
    value = eqn.params[name]
    if isinstance(value, jcore.ClosedJaxpr):
        return value.jaxpr, list(value.consts)
    return value, []


class _Walker:
    """Walks a jaxpr into steps; values get global integer ids."""

    def __init__(self):
        self.next_id = 0
        self.avals: dict[int, Any] = {}
        self.weights: dict[int, _W] = {}
        # Values computed from literals and closed-over arrays alone, folded at
        # trace time (what a constant operand of an op holds).
        self.constants: dict[int, np.ndarray] = {}
        # value id -> the bool value it is the float cast of (a mask made
        # float, ``mask.astype(jnp.float32)``), and the steps that cast.
        self.bool_casts: dict[int, Any] = {}
        # value id -> the integer value it is the float cast of.
        self.integer_casts: dict[int, Any] = {}
        self.cast_steps: list = []
        # id(step) of the steps that compute from parameters alone.
        self.from_params: set[int] = set()
        # value id -> where it was drawn: random numbers folded at trace time
        # (a key closed over: nnx.Rngs, Linen's rngs=), and the places whose
        # draws the model's computation reads (`random_reads`).
        self.random_draws: dict[int, str] = {}
        self.random_reads: set[str] = set()

    def new(self, aval) -> int:
        self.next_id += 1
        self.avals[self.next_id] = aval
        return self.next_id

    def ref(self, env, atom):
        if isinstance(atom, jcore.Literal):
            return _Lit(atom.val)
        return env[atom]

    def is_weight(self, r) -> bool:
        return isinstance(r, _Lit) or r in self.weights

    def walk(self, jaxpr, consts, env, prefix: str, steps: list) -> None:
        for var, c in zip(jaxpr.constvars, consts):
            v = self.new(var.aval)
            self.weights[v] = _W((), _identity(np.ndim(c)))
            self.constants[v] = c if _is_key(c) else np.asarray(c)  # a key: as in fold_constant
            steps.append(_Step(eqn=None, ins=[], outs=[v], fn=(lambda c=c: [c]), kind="constant"))
            env[var] = v
        for eqn in jaxpr.eqns:
            self.walk_eqn(eqn, env, prefix, steps)

    def walk_eqn(self, eqn, env, prefix: str, steps: list) -> None:
        name = eqn.primitive.name
        stack = _join(prefix, str(eqn.source_info.name_stack))
        ins = [self.ref(env, a) for a in eqn.invars]
        if name in ("jit", "pjit") and eqn.params.get("name") in REWRITTEN_FUNCTIONS and len(eqn.outvars) == 1:
            out = self.new(eqn.outvars[0].aval)
            rewritten = self.walk_function(REWRITTEN_FUNCTIONS[eqn.params["name"]], ins, out, stack)
            if rewritten is not None:
                env[eqn.outvars[0]] = out
                steps += rewritten
                return
        if name in ("jit", "pjit") and eqn.params.get("name") not in NAMED_FUNCTIONS:
            return self.inline(eqn, "jaxpr", ins, env, stack, steps)
        if name in _INLINE_CALLS:
            key = next(k for k in ("call_jaxpr", "fun_jaxpr", "jaxpr") if k in eqn.params)
            return self.inline(eqn, key, ins, env, stack, steps)
        mask = self.mask_of(name, eqn, ins)
        if isinstance(mask, tuple):
            # An integer mask cast to float and compared with zero (CLIP's
            # ``jnp.logical_and`` of a mask made float): the integers compared,
            # exactly; the float cast is then dropped like a bool mask's.
            integer, compare = mask
            out = self.new(eqn.outvars[0].aval)
            env[eqn.outvars[0]] = out
            steps += self.walk_function(compare, [integer], out, stack)
            return
        if mask is not None:
            # A float mask compared back to bool (``mask > 0``, ``mask != 0``,
            # ``mask.astype(bool)``, as attention code does): the bool mask
            # itself, exactly. The float mask then has no reader and its cast
            # is dropped (`drop_unread_casts`): it would be a float op.
            env[eqn.outvars[0]] = mask
            return
        if name == "convert_element_type" and eqn.invars[0].aval.dtype == eqn.outvars[0].aval.dtype:
            # Only the weak type changes (``x += (1.0 - mask) * -1e4``, as BigBird
            # writes it): the same values, no op.
            env[eqn.outvars[0]] = ins[0]
            return
        outs = [self.new(o.aval) for o in eqn.outvars]
        for o, v in zip(eqn.outvars, outs):
            env[o] = v
        if name == "scan" and not all(self.is_weight(r) for r in ins):
            steps.append(self.scan_region(eqn, ins, outs, stack))
            return
        step = _Step(eqn=eqn, ins=ins, outs=outs, stack=stack, kind=KIND_NAMES.get(name, name))
        if name == "integer_pow" and eqn.params.get("y") == 2:
            step.kind = "square"  # x ** 2 (jnp.power(x, 2), as transformers' RMSNorms write it) is x * x
        if name in ("jit", "pjit"):
            step.kind = eqn.params["name"]
            step.fn = _inline_call(eqn.params["jaxpr"])
        step.einsum = _einsum_of(stack)
        if (name == "convert_element_type" and np.issubdtype(eqn.outvars[0].aval.dtype, np.floating)
                and not self.is_weight(ins[0])):
            if eqn.invars[0].aval.dtype == np.bool_:
                self.bool_casts[outs[0]] = ins[0]
                self.cast_steps.append(step)
            elif np.issubdtype(eqn.invars[0].aval.dtype, np.integer):
                self.integer_casts[outs[0]] = ins[0]
                self.cast_steps.append(step)
        if all(self.is_weight(r) for r in ins):
            if any(self.weights[r].params for r in ins if not isinstance(r, _Lit)):
                self.from_params.add(id(step))
            for v in outs:
                self.weights[v] = _propagate(eqn, [self.weights.get(r) for r in ins if not isinstance(r, _Lit)],
                                             ins, self)
            self.fold_constant(step)
        self.note_random(name, step)
        steps.append(step)

    def note_random(self, name: str, step: _Step) -> None:
        """Follows random numbers drawn from a constant key: each value
        computed from them alone is a draw too; a step that also reads the
        model's inputs reads the draw (`random_reads`)."""
        drawn = [self.random_draws[r] for r in step.ins if not isinstance(r, _Lit) and r in self.random_draws]
        if name == "random_bits":
            drawn.append(step.stack)
        if not drawn:
            return
        if all(self.is_weight(r) for r in step.ins):
            self.random_draws.update((v, drawn[0]) for v in step.outs)
        else:
            self.random_reads.add(drawn[0])

    def mask_of(self, name: str, eqn, ins: list):
        """The bool mask a comparison of a float-cast mask with zero gives back
        (``cast(m) > 0``, ``cast(m) != 0``, ``0 < cast(m)``), or that a cast of
        it to bool gives back; for a float-cast integer mask, ``(m, compare)``:
        the same comparison of the integers; None for anything else."""
        if name == "convert_element_type":
            if eqn.outvars[0].aval.dtype == np.bool_ and not isinstance(ins[0], _Lit):
                if ins[0] in self.integer_casts:
                    return (self.integer_casts[ins[0]], lambda m: m != 0)
                return self.bool_casts.get(ins[0])
            return None
        if name not in ("gt", "ne", "lt") or len(ins) != 2:
            return None
        for i in (0, 1):
            other = ins[1 - i]
            r = ins[i]
            if isinstance(r, _Lit) or (r not in self.bool_casts and r not in self.integer_casts):
                continue
            value = other.value if isinstance(other, _Lit) else self.constants.get(other)
            if value is None or np.any(np.asarray(value) != 0):
                continue
            if r in self.integer_casts:
                integer = self.integer_casts[r]
                if tuple(eqn.outvars[0].aval.shape) != tuple(self.avals[integer].shape):
                    return None
                if name == "ne":
                    return (integer, lambda m: m != 0)
                if (name == "gt") == (i == 0):
                    return (integer, lambda m: m > 0)  # cast(m) > 0, 0 < cast(m)
                return (integer, lambda m: m < 0)  # 0 > cast(m), cast(m) < 0
            if name != "ne" and (name == "gt") != (i == 0):
                continue  # 0 > cast(m) and cast(m) < 0 are never true of a bool mask
            mask = self.bool_casts[r]
            if tuple(eqn.outvars[0].aval.shape) == tuple(self.avals[mask].shape):
                return mask
        return None

    def drop_unread_casts(self, steps: list, outvars: list) -> None:
        """Removes the mask casts whose float value nothing reads any more."""
        read = {r for step in steps for r in step.ins if not isinstance(r, _Lit)}
        read |= {r for r in outvars if not isinstance(r, _Lit)}
        dropped = {id(step) for step in self.cast_steps if step.outs[0] not in read}
        steps[:] = [step for step in steps if id(step) not in dropped]

    def steps_from_params(self, steps: list, outvars: list) -> set[int]:
        """id(step) of the steps of no op to compute eagerly: those computing
        from parameters, and the constant steps only they or loops read (a
        gather's fill value, a loop's start value); not the constants an
        activation op reads (an average pool's window counts, which the
        converter matches as a pattern)."""
        readers: dict[int, list[int]] = {}
        for step in steps:
            for r in step.ins:
                if not isinstance(r, _Lit):
                    readers.setdefault(r, []).append(id(step))
        out = set(self.from_params)
        # A loop's start values (an RNN's zero state) too: the first step then
        # reads a constant, as the unrolled loop's later steps read activations.
        loops = {id(step) for step in steps if isinstance(step, _Region)}
        exported = {r for r in outvars if not isinstance(r, _Lit)}
        for step in reversed(steps):
            if id(step) in out or isinstance(step, _Region) or not step.outs:
                continue
            if not all(self.is_weight(r) for r in step.ins):
                continue
            reads = [s for v in step.outs for s in readers.get(v, ())]
            if (reads and all(s in out or s in loops for s in reads)
                    and not any(v in exported for v in step.outs)):
                out.add(id(step))
        return out

    def fold_constant(self, step: _Step) -> None:
        if step.fn is not None or any(isinstance(p, (jcore.ClosedJaxpr, jcore.Jaxpr))
                                      for p in step.eqn.params.values()):
            return
        values = []
        for r in step.ins:
            if isinstance(r, _Lit):
                values.append(r.value)
            elif r in self.constants:
                values.append(self.constants[r])
            else:
                return
        # Eagerly, even when the model is traced again inside a caller's jit
        # (a new batch size): there every bind would be staged as a tracer.
        with jax.ensure_compile_time_eval():
            outs = _eval_eqn(step.eqn, values)
        for v, x in zip(step.outs, outs):
            # A PRNG key (``jax.random.key``, as nn.RNN makes one to initialize its
            # carry) has no NumPy form; it is kept as the key array.
            self.constants[v] = x if _is_key(x) else np.asarray(x)

    def walk_function(self, fn, operands: list, out: int, stack: str) -> list | None:
        """The steps of ``fn(*operands)`` walked like the model's own, its
        result written to the existing value `out` (a rewrite of the steps
        that computed it); None when its result has another shape."""
        closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(self.avals[r].shape, self.avals[r].dtype)
                                      for r in operands])
        if closed.out_avals[0].shape != self.avals[out].shape:
            return None
        env = dict(zip(closed.jaxpr.invars, operands))
        new: list = []
        self.walk(closed.jaxpr, closed.consts, env, stack, new)
        produced = env[closed.jaxpr.outvars[0]]
        last = next(s for s in new if produced in s.outs)
        last.outs = [out if v == produced else v for v in last.outs]
        return new

    def inline(self, eqn, key, ins, env, stack, steps):
        inner, consts = _subjaxpr(eqn, key)
        inner_env = {}
        n_in = len(inner.invars)
        for var, r in zip(inner.invars, ins[len(ins) - n_in:]):
            inner_env[var] = r
        self.walk(inner, consts, inner_env, stack, steps)
        for o, inner_o in zip(eqn.outvars, inner.outvars):
            env[o] = self.ref(inner_env, inner_o)

    def scan_region(self, eqn, ins, outs, stack) -> _Region:
        body_jaxpr, consts = _subjaxpr(eqn, "jaxpr")
        nc, ncarry = eqn.params["num_consts"], eqn.params["num_carry"]
        env, invars = {}, []
        for i, (var, r) in enumerate(zip(body_jaxpr.invars, ins)):
            v = self.new(var.aval)
            env[var] = v
            invars.append(v)
            w = None if isinstance(r, _Lit) else self.weights.get(r)
            if isinstance(r, _Lit) or (w is not None and i < nc):
                self.weights[v] = w if w is not None else _W((), None)
            elif w is not None and i >= nc + ncarry:  # a stacked weight, sliced per iteration
                am = w.axis_map
                stacked = w.stacked + ((am[0],) if am and am[0] is not None else ())
                self.weights[v] = _W(w.params, am[1:] if am else None, stacked)
        body_steps: list = []
        self.walk(body_jaxpr, consts, env, stack, body_steps)
        outvars = [self.ref(env, o) for o in body_jaxpr.outvars]
        return _Region(eqn=eqn, ins=ins, outs=outs, body=_Program(invars, body_steps, outvars), stack=stack)


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)


def _join(prefix: str, stack: str) -> str:
    return "/".join(p for p in (prefix, stack) if p)


def _einsum_of(stack: str) -> str | None:
    for part in stack.split("/"):
        if "->" in part:
            return part
    return None


def _identity(ndim: int) -> tuple[int, ...]:
    return tuple(range(ndim))


def _propagate(eqn, in_ws: list, ins, walker) -> _W:
    """The parameters and axis map of a value computed from weights only."""
    params = tuple(dict.fromkeys(p for w in in_ws if w is not None for p in w.params))
    stacked = tuple(dict.fromkeys(a for w in in_ws if w is not None for a in w.stacked))
    first = in_ws[0] if in_ws else None
    am = first.axis_map if first is not None and len(in_ws) == 1 else None
    arithmetic = (any(w is not None and w.arithmetic for w in in_ws) or len(params) > 1
                  or eqn.primitive.name not in _LAYOUT)
    return _W(params, _map_axes(eqn, am), stacked, arithmetic)


def _map_axes(eqn, am):
    if am is None:
        return None
    name, p = eqn.primitive.name, eqn.params
    out_shape = eqn.outvars[0].aval.shape
    in_shape = eqn.invars[0].aval.shape
    if name in _SAME_AXES:
        return am
    if name == "transpose":
        return tuple(am[i] for i in p["permutation"])
    if name == "broadcast_in_dim":
        out = [None] * len(out_shape)
        for j, d in enumerate(p["broadcast_dimensions"]):
            if in_shape[j] == out_shape[d]:
                out[d] = am[j]
        return tuple(out)
    if name in ("reshape", "squeeze"):
        kept_in = [a for a, s in zip(am, in_shape) if s != 1]
        if [s for s in in_shape if s != 1] != [s for s in out_shape if s != 1]:
            return None
        it = iter(kept_in)
        return tuple(next(it) if s != 1 else None for s in out_shape)
    return None
