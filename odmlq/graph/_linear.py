"""How a matmul or convolution reads its weight: the weight as a matrix, and
its input as the rows that matrix multiplies (internal; `odmlq.graph`).

Algorithms that round weights against the data (GPTQ) need, for one weight,
the second moment of what multiplies it: for ``y = x @ W`` the rows of ``x``;
for a convolution, every input patch a kernel window covers (an im2col). Both
come from the op as traced, with no knowledge of strides, padding or layouts:
the op's one matmul or convolution that reads the weight is found in
``jax.make_jaxpr`` of the op (its *anchor*), and

- a ``dot_general`` gives the rows of its other operand, contracted axes
  last, in the weight's order of contracted axes;
- a ``conv_general_dilated`` gives its input patches by convolving the input
  with an identity kernel (one output feature per kernel tap), with the op's
  own strides, padding, dilations and feature groups.

`WeightLayout.matrix` lays the weight out as ``(groups, outputs per group,
taps)``, columns in the patches' order, so that ``patches @ matrix[g].T`` is
the op's output for group ``g`` (before any epilogue).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

__all__ = ["WeightLayout", "weight_inputs"]

_ANCHORS = ("dot_general", "conv_general_dilated")


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """Where a weight's outputs and contracted axes are.

    Attributes:
      out_axes: the weight's axes that index outputs (in order).
      in_axes: the weight's contracted axes, in the order of a patch's
        columns (a convolution's input features first, then its taps).
      groups: feature groups (a depthwise convolution has one per channel).
    """

    out_axes: tuple[int, ...]
    in_axes: tuple[int, ...]
    groups: int = 1

    def matrix(self, w: np.ndarray) -> np.ndarray:
        """`w` as ``(groups, outputs per group, taps)``."""
        w = np.asarray(w)
        outputs = math.prod(w.shape[a] for a in self.out_axes)
        m = np.transpose(w, self.out_axes + self.in_axes).reshape(outputs, -1)
        return m.reshape(self.groups, outputs // self.groups, m.shape[-1])

    def from_matrix(self, m: np.ndarray, shape: Sequence[int]) -> np.ndarray:
        """Inverse of `matrix`, for a weight of `shape`."""
        order = self.out_axes + self.in_axes
        w = np.reshape(m, [shape[a] for a in order])
        return np.transpose(w, np.argsort(order))

    def to_dict(self) -> dict:
        return {"out_axes": list(self.out_axes), "in_axes": list(self.in_axes), "groups": self.groups}

    @classmethod
    def from_dict(cls, d: dict) -> "WeightLayout":
        return cls(tuple(d["out_axes"]), tuple(d["in_axes"]), int(d["groups"]))


def weight_inputs(compute: Callable, operands: Sequence[Any], weight_index: int
                  ) -> tuple[WeightLayout, jax.Array] | str:
    """``(layout, patches)`` of the weight `operands[weight_index]` of an op, or
    why there are none (a string).

    `patches` has shape ``(rows, groups, taps)``: one row per output position
    (batch included), what the weight's matrix (`WeightLayout.matrix`)
    multiplies. Traceable (calibration runs it under `jax.jit`).
    """
    closed = jax.make_jaxpr(compute)(*operands)
    invars = closed.jaxpr.invars
    weight = invars[weight_index]
    readers = [i for i, e in enumerate(closed.jaxpr.eqns) if weight in e.invars]
    if len(readers) != 1 or closed.jaxpr.eqns[readers[0]].primitive.name not in _ANCHORS:
        return "its weight is read by other than one matmul or convolution, as it is"
    eqn = closed.jaxpr.eqns[readers[0]]
    side = eqn.invars.index(weight)
    x = _value_before(closed, readers[0], eqn.invars[1 - side], operands)
    w_shape = tuple(np.shape(operands[weight_index]))
    if eqn.primitive.name == "dot_general":
        return _dot_inputs(eqn.params["dimension_numbers"], side, x, w_shape)
    if side != 1:
        return "its convolution reads the weight as the input"
    return _conv_inputs(eqn.params, x, w_shape)


def _value_before(closed, index: int, var, operands: Sequence[Any]) -> jax.Array:
    """The value `var` holds when equation `index` runs."""
    if isinstance(var, jcore.Literal):
        return jnp.asarray(var.val)
    if var in closed.jaxpr.invars:
        return operands[closed.jaxpr.invars.index(var)]
    if var in closed.jaxpr.constvars:
        return closed.consts[closed.jaxpr.constvars.index(var)]
    jaxpr = closed.jaxpr
    info = jcore.DebugInfo("odmlq", "weight_inputs", tuple(f"x{i}" for i in range(len(jaxpr.invars))),
                           ("y0",))
    head = jcore.Jaxpr(constvars=jaxpr.constvars, invars=jaxpr.invars, outvars=[var],
                       eqns=jaxpr.eqns[:index], effects=jaxpr.effects, debug_info=info)
    (value,) = jax.core.eval_jaxpr(head, closed.consts, *operands, propagate_source_info=False)
    return value


def _dot_inputs(dimension_numbers, side: int, x: jax.Array, w_shape: tuple[int, ...]):
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if lhs_batch or rhs_batch:
        return "its matmul has batch dimensions on the weight"
    w_contract, x_contract = (lhs_contract, rhs_contract) if side == 0 else (rhs_contract, lhs_contract)
    layout = WeightLayout(out_axes=tuple(a for a in range(len(w_shape)) if a not in w_contract),
                          in_axes=tuple(w_contract))
    x = jnp.moveaxis(x, tuple(x_contract), tuple(range(x.ndim - len(x_contract), x.ndim)))
    taps = math.prod(w_shape[a] for a in w_contract)
    return layout, x.reshape(-1, 1, taps)


def _conv_inputs(params: dict, x: jax.Array, w_shape: tuple[int, ...]):
    if params["batch_group_count"] != 1:
        return "its convolution has batch groups"
    dn = params["dimension_numbers"]
    out_axis, in_axis, spatial = dn.rhs_spec[0], dn.rhs_spec[1], tuple(dn.rhs_spec[2:])
    groups = params["feature_group_count"]
    window = tuple(w_shape[a] for a in spatial)
    taps = w_shape[in_axis] * math.prod(window)
    # Output feature g * taps + t of group g reads (input feature, window
    # position) number t of that group: an identity over each group's taps.
    identity = np.tile(np.eye(taps, dtype=np.float32), (groups, 1)).reshape(
        groups * taps, w_shape[in_axis], *window)
    kernel = np.moveaxis(identity, tuple(range(identity.ndim)), (out_axis, in_axis, *spatial))
    patches = lax.conv_general_dilated_p.bind(
        x, jnp.asarray(kernel, x.dtype), **{**params, "preferred_element_type": None})
    patches = jnp.moveaxis(patches, dn.out_spec[1], -1)
    layout = WeightLayout(out_axes=(out_axis,), in_axes=(in_axis, *spatial), groups=groups)
    return layout, patches.reshape(-1, groups, taps)


def transposed_by_phases(params) -> bool:
    """Whether a transposed convolution (input dilation) is a stride-1
    convolution of its stride phases, interleaved (`odmlq.litert._conv_transpose`):
    no window stride besides, one feature group, one or two spatial axes."""
    return bool(any(d != 1 for d in params["lhs_dilation"]) and all(s == 1 for s in params["window_strides"])
                and params["feature_group_count"] == 1 and params["batch_group_count"] == 1
                and len(params["window_strides"]) <= 2)


def phase_axis(s: int, lo: int, size: int, kernel: int, out_size: int):
    """One spatial axis of a transposed convolution (input dilation `s`, low
    padding `lo`, `size` inputs, a `kernel` of that extent, dilation written
    out, `out_size` outputs) as a stride-1 convolution of its phases: (tap
    per (phase, position): ``kernel`` for none, positions per phase, (input
    start, stop, zeros before, zeros after)). Phase ``r`` reads taps
    ``t0 + s u`` (``t0 = (lo - r) mod s``) at inputs ``m + c_r + u``
    (`odmlq.litert._conv_transpose`)."""
    rows = []
    for r in range(s):
        t0 = (lo - r) % s
        rows.append((t0, (r + t0 - lo) // s, max(0, -(-(kernel - t0) // s))))
    first = min(c for _, c, _ in rows)
    length = max(1, max(c - first + k for _, c, k in rows))
    taps = np.full((s, length), kernel, np.int64)  # index `kernel`: the zero tap
    for r, (t0, c, k) in enumerate(rows):
        for u in range(k):
            taps[r, c - first + u] = t0 + s * u
    positions = -(-out_size // s)
    last = positions - 1 + first + length - 1  # the last input position read
    start, left = (first, 0) if first > 0 else (0, -first)
    stop, right = (last + 1, 0) if last < size else (size, last - size + 1)
    return taps, positions, (start, stop, left, right)


def phase_axes(params, in_shape, kernel_shape, out_shape) -> list:
    """`phase_axis` for each spatial axis of a transposed convolution with these
    parameters and shapes (the kernel's as stored: its dilation is written out here)."""
    lhs, rhs, out = params["dimension_numbers"]
    return [phase_axis(int(s), int(params["padding"][j][0]), int(in_shape[lhs[2 + j]]),
                       (int(kernel_shape[rhs[2 + j]]) - 1) * int(params["rhs_dilation"][j]) + 1,
                       int(out_shape[out[2 + j]]))
            for j, s in enumerate(params["lhs_dilation"])]


def pointwise(conv_eqn) -> int | None:
    """The input's feature axis if a ``conv_general_dilated`` is a matmul over
    pixels (a 1x1 kernel, stride 1, no padding or dilation, one feature group:
    XNNPACK runs it as a matrix multiplication whose rows are the pixels; or a
    transposed one whose phases' filter is 1x1), else None."""
    p = conv_eqn.params
    numbers = p["dimension_numbers"]
    kernel = conv_eqn.invars[1].aval.shape
    if transposed_by_phases(p):
        # Its phases' convolution has a 1x1 filter (a 2x2 kernel at stride 2, 'SAME').
        axes = phase_axes(p, conv_eqn.invars[0].aval.shape, kernel, conv_eqn.outvars[0].aval.shape)
        return int(numbers.lhs_spec[1]) if all(taps.shape[1] == 1 for taps, _, _ in axes) else None
    plain = (all(kernel[i] == 1 for i in numbers.rhs_spec[2:]) and all(s == 1 for s in p["window_strides"])
             and all(tuple(pad) == (0, 0) for pad in p["padding"])
             and all(d == 1 for d in tuple(p.get("lhs_dilation") or ()) + tuple(p.get("rhs_dilation") or ()))
             and p["feature_group_count"] == 1 and p["batch_group_count"] == 1)
    return int(numbers.lhs_spec[1]) if plain else None
