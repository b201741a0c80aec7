"""Quantized matmuls in the reference semantics: exact integer sums, then the scales.

Internal; `odmlq.hooks.PlanHooks` uses it for `FakeQuant` (what `simulate` runs).

Fake quantization puts both operands of a matmul on integer grids (``code *
scale``). Summing the products of those dequantized float32 values rounds at
every step; an integer kernel (LiteRT's, XNNPACK's, `odmlq.xla`'s) sums the
codes exactly and applies the scales once. Both are "the quantized matmul",
but they differ by float rounding that grows with the contracted size, and a
near tie (a language model's two best next tokens) then goes one way in
simulate and the other on every integer backend. So where both operands of a
``dot_general`` sit on integer grids of at most 8 bits, the reference sums
the codes exactly and multiplies by the input's scale, then the weight's (the
order of XNNPACK's dynamic-range kernels, ``(sum * input step) * channel
scale``, and of `odmlq.xla`: on identical inputs a decode step of the sample
decoder then gives LiteRT's logits bit for bit, where the other order left
1e-6); a weight with block scales along the contracted axis
gets one exact sum per block, each scaled, the blocks added one after another
from the first (`odmlq.qarray.kernels.block_sums_in_order`, which `odmlq.xla`
adds its blocks with too; XNNPACK's blockwise kernels add them in that order).
What is left between this and XNNPACK: its blockwise kernels start from the
input zero point's term, a float, and add the blocks' sums of the raw codes
to it, so their additions round elsewhere.

Sums of codes stay exact in float32 while every partial sum is below 2**24
(the contracted size times the largest product); past that, one operand's
codes are split in two parts whose sums are (`_dot`).
Convolutions keep summing dequantized values.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax import lax

from odmlq.graph import evaluate_replacing
from odmlq.qarray import kernels

__all__ = ["Grid", "grid", "integer_sums"]

_EXACT_F32 = 2**24
_SPLIT = 16


@dataclasses.dataclass(frozen=True)
class Grid:
    """An operand's integer grid: ``value = code * scale`` (codes already
    minus any zero point), `scale` keepdims-shaped to the operand (blocks of
    `block_size` along `block_axis`); `largest` bounds ``|code|``."""

    scale: jax.Array
    block_axis: int | None
    block_size: int | None
    largest: int
    # A weight's contracted axes, in the operand's axes, where known: a matmul
    # that contracts others reads a view of it laid out otherwise.
    contraction: tuple[int, ...] | None = None

    def codes(self, x: jax.Array) -> jax.Array:
        scale = self.scale
        if self.block_axis is not None:
            scale = jnp.repeat(scale, self.block_size, axis=self.block_axis)
        return jnp.round(x.astype(jnp.float32) / scale)

    def transposed(self, permutation) -> "Grid":
        where = list(permutation)
        block_axis = None if self.block_axis is None else where.index(self.block_axis)
        contraction = None if self.contraction is None else tuple(sorted(where.index(a) for a in self.contraction))
        return dataclasses.replace(self, scale=jnp.transpose(self.scale, permutation), block_axis=block_axis,
                                   contraction=contraction)

    def read_contracting(self, axes) -> "Grid | None":
        """This grid for a matmul contracting `axes` of the operand: itself, the
        transpose of a 2-D weight read transposed, or None (another layout)."""
        axes = tuple(sorted(axes))
        if self.contraction is None or axes == self.contraction:
            return self
        if self.scale.ndim == 2 and axes == tuple(sorted(1 - a for a in self.contraction)):
            return self.transposed((1, 0))
        return None


def grid(qtype, scale, zero_point, shape, block_axis: int | None = None,
         block_size: int | None = None, contraction: tuple[int, ...] | None = None) -> Grid | None:
    """The grid of an integer qtype of at most 8 bits on an operand of `shape`
    (None for other qtypes, or for a scale not keepdims-shaped to the operand)."""
    if qtype.kind != "int" or qtype.bits > 8:
        return None
    scale = jnp.asarray(scale, jnp.float32)
    if scale.ndim != len(shape):
        if scale.size != 1:
            return None
        scale = scale.reshape((1,) * len(shape))
    def fits(shape):
        expected = [d // block_size if a == block_axis else d for a, d in enumerate(shape)]
        return all(s in (1, e) for s, e in zip(scale.shape, expected))

    if not fits(shape):
        # A 2-D weight read as a transposed view: the grid in the weight's own
        # layout, which `Grid.read_contracting` transposes for the matmul.
        if not (contraction is not None and len(shape) == 2 and fits(tuple(shape)[::-1])):
            return None
    # An asymmetric code minus its zero point spans up to 2**bits - 1.
    largest = 2 ** qtype.bits - 1 if zero_point is not None else 2 ** (qtype.bits - 1)
    return Grid(scale, block_axis, block_size, largest,
                None if contraction is None else tuple(sorted(contraction)))


def integer_sums(compute: Callable, operands: list, grids: Mapping[int, Grid], weight: int | None) -> Callable:
    """`compute` (a traced op) with each dot_general whose two operands are op
    operands on grids (directly or transposed) summed exactly; `compute`
    itself where there is none. `weight`: the index of the weight operand."""
    if len(grids) < 2:
        return compute
    closed = jax.make_jaxpr(compute)(*operands)
    known = {v: (i, grids[i]) for i, v in enumerate(closed.jaxpr.invars) if i in grids}
    replace = {}
    for n, eqn in enumerate(closed.jaxpr.eqns):
        if eqn.primitive.name == "transpose" and eqn.invars[0] in known:
            index, g = known[eqn.invars[0]]
            known[eqn.outvars[0]] = (index, g.transposed(eqn.params["permutation"]))
        elif eqn.primitive.name == "dot_general" and all(v in known for v in eqn.invars[:2]):
            (ia, ga), (_, gb) = known[eqn.invars[0]], known[eqn.invars[1]]
            (lc, rc), _ = eqn.params["dimension_numbers"]
            ga, gb = ga.read_contracting(lc), gb.read_contracting(rc)
            if ga is None or gb is None:
                continue
            lhs_scaled_first = weight is not None and weight != ia  # the input's scale first
            kernel = _exact_dot(eqn.params["dimension_numbers"], ga, gb, lhs_scaled_first)
            if kernel is not None:
                replace[n] = kernel
    if not replace:
        return compute
    return lambda *xs: evaluate_replacing(closed, xs, replace)


def _exact_dot(dimension_numbers, ga: Grid, gb: Grid, lhs_scaled_first: bool):
    """``(eqn, [a, b]) -> [a . b]`` summed on the codes, or None where a scale
    varies along a contracted axis other than one side's block axis."""
    (lc, rc), (lb, rb) = dimension_numbers
    blocked = [g.block_axis is not None and g.block_axis in c for g, c in ((ga, lc), (gb, rc))]
    for g, c in ((ga, lc), (gb, rc)):
        if any(g.scale.shape[a] != 1 for a in c if a != g.block_axis):
            return None
        if g.block_axis is not None and g.block_axis not in c:
            return None  # blocks along a free axis: not a kernel's layout
    if all(blocked):
        return None

    def kernel(eqn, ins):
        a, b = ins
        out_dtype = eqn.outvars[0].aval.dtype
        ca, cb = ga.codes(a), gb.codes(b)
        frees = (len(_free(a.ndim, lc, lb)), len(_free(b.ndim, rc, rb)))
        if not any(blocked):
            k = math.prod(a.shape[ax] for ax in lc)
            sums = _dot(ca, cb, dimension_numbers, k, ga.largest, gb.largest)
            sa, sb = _out_scale(ga.scale, lc, lb, 0, frees), _out_scale(gb.scale, rc, rb, 1, frees)
            first, second = (sa, sb) if lhs_scaled_first else (sb, sa)
            # The barrier keeps XLA from multiplying the two scales first.
            return [(lax.optimization_barrier(sums * first) * second).astype(out_dtype)]
        # One side has block scales along a contracted axis: that axis (and
        # its partner on the other side) split into (blocks, block size), the
        # blocks a leading batch axis of the sums.
        side = 0 if blocked[0] else 1
        gw = (ga, gb)[side]
        position = (lc, rc)[side].index(gw.block_axis)
        axes = (lc[position], rc[position])
        size = gw.block_size
        split = [_split(c, ax, size) for c, ax in zip((ca, cb), axes)]
        dn = (tuple(tuple(_after(a, ax) + (a == ax) for a in c) for c, ax in zip((lc, rc), axes)),
              tuple((ax,) + tuple(_after(a, ax) for a in bt) for bt, ax in zip((lb, rb), axes)))
        sums = _dot(split[0], split[1], dn, size, ga.largest, gb.largest)
        other = 1 - side
        other_scale = _out_scale((ga, gb)[other].scale, (lc, rc)[other], (lb, rb)[other], other, frees)
        # The blocked scale: its block axis leads, like the sums' blocks.
        c_w, b_w = (lc, rc)[side], (lb, rb)[side]
        moved = jnp.moveaxis(gw.scale, gw.block_axis, 0)
        b_moved = tuple(1 + (a if a < gw.block_axis else a - 1) for a in b_w)
        c_moved = tuple(1 + (a if a < gw.block_axis else a - 1) for a in c_w if a != gw.block_axis)
        inner = _out_scale(moved, c_moved, (0,) + b_moved, side, frees)
        blocks = lax.optimization_barrier(kernels.block_sums_in_order(sums, inner))
        return [(blocks * other_scale).astype(out_dtype)]

    return kernel


def _dot(a, b, dimension_numbers, k: int, largest_a: int, largest_b: int) -> jax.Array:
    """float32 sums of integer-valued a . b (`k` contracted, ``|a| <=
    largest_a``, ``|b| <= largest_b``), exact as an int32 sum converted to
    float32 is. Where a float32 dot could round a partial sum, the operand
    with the larger codes is split as ``SPLIT * high + low`` (``|high| <=
    largest / SPLIT + 1``, ``0 <= low < SPLIT``): both parts, stacked along
    one of its free axes, go through one float32 dot whose sums are exact
    (1.3x a float dot here, where an int32 dot is 3x). An int32 dot only
    where even that could round, or the operand has no free axis."""
    (lc, rc), (lb, rb) = dimension_numbers

    def dot(x, y):
        return lax.dot_general(x, y, dimension_numbers, precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)

    if k * largest_a * largest_b < _EXACT_F32:
        return dot(a, b)
    side = 0 if largest_a >= largest_b else 1
    big, other = (largest_a, largest_b) if side == 0 else (largest_b, largest_a)
    x = (a, b)[side]
    free = _free(x.ndim, (lc, rc)[side], (lb, rb)[side])
    if free and k * max(big // _SPLIT + 1, _SPLIT) * other < _EXACT_F32:
        axis = free[0]
        high = jnp.floor(x / _SPLIT)
        stacked = jnp.concatenate([high, x - _SPLIT * high], axis=axis)
        sums = dot(stacked, b) if side == 0 else dot(a, stacked)
        # Where that axis lands in the output: after the batch axes, among its side's free axes.
        out_axis = len(lb) + (0 if side == 0 else len(_free(a.ndim, lc, lb)))
        n = x.shape[axis]
        upper = lax.slice_in_dim(sums, 0, n, axis=out_axis)
        lower = lax.slice_in_dim(sums, n, 2 * n, axis=out_axis)
        # Both are integers below 2**24, so exact; the add rounds only where the
        # true sum passes 2**24, as an int32 sum's conversion to float32 does.
        return upper * _SPLIT + lower
    return lax.dot_general(a.astype(jnp.int32), b.astype(jnp.int32), dimension_numbers,
                           preferred_element_type=jnp.int32).astype(jnp.float32)


def _free(ndim: int, contract, batch) -> tuple[int, ...]:
    return tuple(i for i in range(ndim) if i not in contract and i not in batch)


def _out_scale(scale: jax.Array, contract, batch, side: int, frees: tuple[int, int]) -> jax.Array:
    """A keepdims scale (size 1 along `contract`) of operand `side` (0: lhs,
    1: rhs) laid out as dot_general's output: batch axes, the lhs's free axes,
    the rhs's (`frees`: how many each side has; the other side's are units)."""
    before, after = (0, frees[1]) if side == 0 else (frees[0], 0)
    free = _free(scale.ndim, contract, batch)
    s = jnp.transpose(scale, tuple(batch) + free + tuple(contract))
    s = s.reshape(s.shape[:len(batch) + len(free)])
    shape = s.shape[:len(batch)] + (1,) * before + s.shape[len(batch):] + (1,) * after
    return s.reshape(shape)


def _split(x: jax.Array, axis: int, size: int) -> jax.Array:
    return x.reshape(x.shape[:axis] + (x.shape[axis] // size, size) + x.shape[axis + 1:])


def _after(a: int, axis: int) -> int:
    """Where axis `a` lands once `axis` is split in two (the blocks stay at `axis`)."""
    return a + 1 if a > axis else a
