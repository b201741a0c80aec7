"""LayerNorm and RMSNorm recognised as one norm and written in the form that
quantizes well (internal; used by `_trace`).

Flax's `LayerNorm` (and every model built on it: transformers' Flax BERT,
GPT-2, ViT) traces as ``var = max(0, mean(x^2) - mean(x)^2)`` and
``y = (x - mean) * (rsqrt(var + eps) * scale) + bias``; `RMSNorm` as
``y = (x - 0) * (rsqrt(mean(x^2) + eps) * scale)``. Both orders are poor in
integers:

- ``mean(x^2) - mean(x)^2`` cancels: where the mean is large against the
  spread, the int8 difference of two int8 means is mostly rounding.
- ``rsqrt(var + eps) * scale`` is quantized before it meets the centered
  values, so a row of zero variance (a row a ReLU zeroed) puts
  ``1/sqrt(eps)`` into its range and every other row's ``1/sigma`` rounds to
  zero: the fuzzer's ReLU -> LayerNorm exported at -1.9 dB while every op
  matched simulate.

The chain is matched by its data flow (whatever the variance form, with or
without scale and bias) and replaced by the same function in one order:
``c = x - mean(x)`` (LayerNorm) or ``c = x`` (RMSNorm),
``r = rsqrt(mean(c^2) + eps)``, ``n = c * r``, ``y = n * scale + bias``. The
normalized ``n`` is bounded (|n| <= sqrt(count)) whatever a row's variance,
and the plan calibrates ``r`` without the rows whose variance is under the
norm's own eps (`plan/_passes.calibrate_norms`), whose centered values are
zero. In float the two forms agree to float32 rounding.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from odmlq.graph._program import _Lit, _Region, _Step

# Step kinds a norm's chain is made of.
_NORM_KINDS = frozenset({"square", "integer_pow", "mul", "reduce_sum", "div", "sub", "max", "add",
                         "broadcast_in_dim", "reshape", "rsqrt", "neg", "select_n"})
_SHAPE_KINDS = ("broadcast_in_dim", "reshape")


def rewrite_norms(walker, steps: list, outvars: list) -> None:
    """Replaces each LayerNorm/RMSNorm chain of `steps` (and of scan bodies) in place."""
    for step in steps:
        if isinstance(step, _Region):
            rewrite_norms(walker, step.body.steps, step.body.outvars)
    for step in list(steps):
        if isinstance(step, _Step) and step.kind == "rsqrt" and step.eqn is not None and step in steps:
            match = _Matcher(walker, steps, outvars).match(step)
            if match is not None:
                _replace(walker, steps, step.stack, *match)


class _Matcher:
    def __init__(self, walker, steps: list, outvars: list):
        self.w = walker
        self.steps = steps
        self.producer = {v: s for s in steps for v in s.outs}
        self.readers: dict[int, list] = {}
        for s in steps:
            for r in s.ins:
                if not isinstance(r, _Lit):
                    self.readers.setdefault(r, []).append(s)
        self.exported = {r for r in outvars if not isinstance(r, _Lit)}

    def _step(self, v, kind: str):
        s = None if isinstance(v, _Lit) else self.producer.get(v)
        return s if s is not None and s.eqn is not None and s.kind == kind else None

    def _through(self, v):
        """`v` before broadcasts and reshapes of one activation."""
        while not isinstance(v, _Lit):
            s = self.producer.get(v)
            if s is None or s.kind not in _SHAPE_KINDS or len(s.ins) != 1 or self.w.is_weight(s.ins[0]):
                return v
            v = s.ins[0]
        return v

    def _scalar(self, r) -> float | None:
        value = r.value if isinstance(r, _Lit) else self.w.constants.get(r)
        if value is None or np.size(value) != 1:
            return None
        return float(np.asarray(value).reshape(()))

    def _mean(self, v):
        """(input, axes) when `v` is ``sum(input, axes) / count``."""
        div = self._step(self._through(v), "div")
        if div is None or len(div.ins) != 2:
            return None
        total = self._step(self._through(div.ins[0]), "reduce_sum")
        count = self._scalar(div.ins[1])
        if total is None or count is None:
            return None
        axes = tuple(int(a) for a in total.eqn.params["axes"])
        shape = total.eqn.invars[0].aval.shape
        return (total.ins[0], axes) if count == math.prod(shape[a] for a in axes) else None

    def _square(self, v):
        """The value `v` is the square of, or None."""
        v = self._through(v)
        s = None if isinstance(v, _Lit) else self.producer.get(v)
        if s is None or s.eqn is None:
            return None
        if s.kind == "square" or (s.kind == "integer_pow" and s.eqn.params.get("y") == 2):
            return s.ins[0]
        if s.kind == "mul" and len(s.ins) == 2 and s.ins[0] == s.ins[1]:
            return s.ins[0]
        return None

    def _centered(self, v, axes):
        """(x, True) for ``x - mean(x, axes)``, (x, False) for ``x - 0`` or `x` itself."""
        sub = self._step(self._through(v), "sub")
        if sub is None:
            return v, False
        x, m = sub.ins
        if self._scalar(self._through(m)) == 0.0 or (
                not isinstance(m, _Lit) and m in self.w.constants and not np.any(self.w.constants[m])):
            return x, False
        mean = self._mean(m)
        return (x, True) if mean is not None and mean == (x, axes) else (v, False)

    def match(self, rsqrt):
        """(x, axes, eps, centered, scale, bias, slice steps, output) or None."""
        add = self._step(self._through(rsqrt.ins[0]), "add")
        if add is None or len(add.ins) != 2:
            return None
        eps_at = [i for i, r in enumerate(add.ins) if self._scalar(r) is not None]
        if len(eps_at) != 1 or not self._scalar(add.ins[eps_at[0]]) > 0:
            return None
        eps = self._scalar(add.ins[eps_at[0]])
        var = self._through(add.ins[1 - eps_at[0]])
        clamp = self._step(var, "max")
        if clamp is not None and len(clamp.ins) == 2 and self._scalar(clamp.ins[0]) == 0.0:
            var = self._through(clamp.ins[1])
        var = self._chosen(var)
        found = self._variance(var)
        if found is None:
            return None
        x, axes, centered = found
        if axes != tuple(range(self.w.avals[x].ndim - len(axes), self.w.avals[x].ndim)):
            return None  # only trailing axes: the form LiteRT's MEAN reads best
        r = rsqrt.outs[0]
        affine = self._affine(r, x, axes) if centered else None
        if affine is not None:
            return self._checked(x, axes, eps, centered, *affine)
        first = self._only_reader(r, "mul")
        if first is None:
            return None
        other = first.ins[1] if first.ins[0] == r else first.ins[0]
        scale = None
        if not isinstance(other, _Lit) and self.w.is_weight(other):
            scale, second = other, self._only_reader(first.outs[0], "mul")
            if second is None:
                return None
            cx = second.ins[1] if second.ins[0] == first.outs[0] else second.ins[0]
        else:
            second, cx = first, other
        if self._centered(cx, axes) != (x, centered):
            return None
        out, bias = second.outs[0], None
        add_bias = self._only_reader(out, "add")
        if add_bias is not None:
            b = add_bias.ins[1] if add_bias.ins[0] == out else add_bias.ins[0]
            if not isinstance(b, _Lit) and self.w.is_weight(b) and b != out:
                out, bias = add_bias.outs[0], b
        return self._checked(x, axes, eps, centered, scale, bias, out)

    def _checked(self, x, axes, eps, centered, scale, bias, out):
        for w in (scale, bias):
            if w is not None and not _broadcasts_over(self.w.avals[w].shape, self.w.avals[x].shape, axes):
                return None
        piece = self._slice(x, out)
        if piece is None:
            return None
        return x, axes, eps, centered, scale, bias, piece, out

    def _chosen(self, v):
        """`v` through a select whose predicate is a constant (Keras' variance
        guards a count of zero with ``where(count > 0, var, nan)``)."""
        s = self._step(v, "select_n")
        if s is None or len(s.ins) != 3:
            return v
        predicate = self.w.constants.get(s.ins[0]) if not isinstance(s.ins[0], _Lit) else s.ins[0].value
        if predicate is None or np.size(predicate) == 0:
            return v
        predicate = np.asarray(predicate)
        if predicate.all():
            return self._through(s.ins[2])
        return self._through(s.ins[1]) if not predicate.any() else v

    def _affine(self, r, x, axes):
        """(scale, bias, output) of Keras' form, ``x * i + (bias - mean(x) * i)``
        with ``i = rsqrt(var + eps) * scale``, or None."""
        scale, inv = None, r
        first = self._only_reader(r, "mul")
        if first is not None:
            other = first.ins[1] if first.ins[0] == r else first.ins[0]
            if isinstance(other, _Lit) or not self.w.is_weight(other):
                return None
            scale, inv = other, first.outs[0]
        muls = self.readers.get(inv, [])
        if inv in self.exported or len(muls) != 2 or any(m.kind != "mul" or m.eqn is None for m in muls):
            return None

        def other_of(step):
            return step.ins[1] if step.ins[0] == inv else step.ins[0]

        direct = [m for m in muls if self._through(other_of(m)) == x]
        if len(direct) != 1:
            return None
        shifted = muls[1] if muls[0] is direct[0] else muls[0]
        neg = self._step(self._through(other_of(shifted)), "neg")
        if neg is None or self._mean(neg.ins[0]) != (x, axes):
            return None
        shift, bias = shifted.outs[0], None
        add_bias = self._only_reader(shift, "add")
        if add_bias is not None:
            b = add_bias.ins[1] if add_bias.ins[0] == shift else add_bias.ins[0]
            if not isinstance(b, _Lit) and self.w.is_weight(b):
                shift, bias = add_bias.outs[0], b
        total = self._only_reader(direct[0].outs[0], "add")
        if total is None or set(total.ins) != {direct[0].outs[0], shift}:
            return None
        return scale, bias, total.outs[0]

    def _variance(self, var):
        """(x, axes, centered) of ``mean(c^2)`` or ``mean(x^2) - mean(x)^2``."""
        mean = self._mean(var)
        if mean is not None:
            t = self._square(mean[0])
            if t is None:
                return None
            x, centered = self._centered(t, mean[1])
            return x, mean[1], centered
        sub = self._step(var, "sub")
        if sub is None:
            return None
        second, first = self._mean(sub.ins[0]), self._square(sub.ins[1])
        if second is None or first is None:
            return None
        x = self._square(second[0])
        mean = self._mean(first)
        if x is None or mean != (x, second[1]):
            return None
        return x, second[1], True

    def _only_reader(self, v, kind: str):
        readers = self.readers.get(v, [])
        if len(readers) != 1 or v in self.exported or readers[0].kind != kind or readers[0].eqn is None:
            return None
        return readers[0]

    def _slice(self, x, out) -> list | None:
        """The steps between `x` and `out`, if nothing outside them reads their values."""
        reached, forward = {x}, set()
        for s in self.steps:
            if any(r in reached for r in s.ins if not isinstance(r, _Lit)):
                forward.add(id(s))
                reached.update(s.outs)
        needed, piece = {out}, []
        for s in reversed(self.steps):
            if id(s) in forward and any(v in needed for v in s.outs):
                piece.append(s)
                needed.update(r for r in s.ins if not isinstance(r, _Lit))
        inside = {id(s) for s in piece}
        for s in piece:
            if not isinstance(s, _Step) or s.eqn is None or s.kind not in _NORM_KINDS:
                return None
            for v in s.outs:
                if v != out and (v in self.exported
                                 or any(id(r) not in inside for r in self.readers.get(v, []))):
                    return None
        return piece[::-1]


def _broadcasts_over(shape, x_shape, axes) -> bool:
    """Whether a weight of `shape` broadcasts against x and varies only along `axes`."""
    if len(shape) > len(x_shape):
        return False
    padded = (1,) * (len(x_shape) - len(shape)) + tuple(shape)
    return all(d == 1 or (i in axes and d == x_shape[i]) for i, d in enumerate(padded))


def _replace(walker, steps: list, stack: str, x, axes, eps, centered, scale, bias, piece, out) -> None:
    """Swaps `piece` for the canonical norm, walked like the model's own steps."""
    operands = [r for r in (x, scale, bias) if r is not None]

    def norm(x, *weights):
        weights = list(weights)
        c = x - jnp.mean(x, axis=axes, keepdims=True) if centered else x
        r = lax.rsqrt(jnp.mean(lax.square(c), axis=axes, keepdims=True) + np.float32(eps))
        y = c * r
        if scale is not None:
            y = y * weights.pop(0)
        if bias is not None:
            y = y + weights.pop(0)
        return y

    if any(walker.avals[r].dtype != jnp.float32 for r in operands):
        return
    new = walker.walk_function(norm, operands, out, stack)
    if new is None:
        return
    at = steps.index(piece[-1])
    removed = {id(s) for s in piece}
    steps[:] = [s for s in steps[:at] if id(s) not in removed] + new + [
        s for s in steps[at:] if id(s) not in removed]
