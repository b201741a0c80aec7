"""Quantized matmuls for XLA: a dot_general with one QArray weight.

Internal; `odmlq.xla._lowering` decides which op gets which kernel.

The weight is seen as a (K, N) matrix: contraction axes first, output
channels second (a Dense kernel already is one, so no data moves). The
matmul runs over blocks of rows of that matrix in a `lax.scan`:

- **weight-only** (`dot_float`): each block is decoded and dequantized into
  float32 while it is in cache, multiplied and accumulated in float32. On CPU
  at batch 1 this reads 4x (int8) or 8x (int4) fewer bytes than a float
  matmul; dequantizing the whole weight first writes it back in float and is
  slower than float (bench/README.md).
- **integer** (`dot_int`): int8 x int8 products accumulated in int32 (per
  block, then across blocks), one rescale at the end. An asymmetric
  activation's zero point is folded in with the weight's column sums, which
  come out of the same pass: a row of ones is appended to the activation.
  Blockwise weights rescale each block's int32 sum; the scaled sums are added
  one block after another, from the first, as `simulate` adds them.

Packed int4 / nf4 weights are not unpacked into rows: the low and high
nibbles of a row's bytes are its even and odd columns, so each block runs two
matmuls (one per column group) whose outputs are interleaved at the end.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from odmlq.qarray import QArray
from odmlq.qarray import kernels as qkernels
from odmlq.xla import _decode

# Weight elements per block of the row-blocked matmul: 1 MiB of int8 codes
# (4 MiB once dequantized). Measured in bench/README.md: on a 4096-wide
# weight, 256-row blocks beat 64 and 1024 at batch 32.
BLOCK_ELEMENTS = 2**20
# A matrix-vector product (a decode step: at most this many rows of input)
# reads each weight once, and its block is best kept in this CPU's caches
# between being decoded and being multiplied (bench/README.md, "decode
# steps"). The integer kernel multiplies the int8 codes themselves: 2^16
# elements ran 1.2-1.7x float where 2^20 ran 0.7-1.1x. A weight-only block is
# decoded into float32 first, four bytes an element: 2^13 elements (32 KiB,
# an L1 data cache) ran a whole decode step at 1.01-1.08x float where 2^16
# ran 0.80-0.89x on a small decoder, and the same on a 38M one.
VECTOR_ROWS = 4
VECTOR_BLOCK_ELEMENTS = 2**16
VECTOR_DECODED_BLOCK_ELEMENTS = 2**13
# A large weight decoded in blocks of 2^13 elements is hundreds of scan steps (a 768 x 2,048
# matrix: 192), whose per-step cost shows: on an AMD EPYC with a 1 MiB L2, a 38M decoder's
# weight-only step ran at 0.82x float with 2^13 blocks and 0.94-1.01x with 2^16; on the Xeon
# of the 2^13 measurement, 2^13 and 2^16 tied there (1.01-1.02x), and its small decoder kept
# 2^13 (its largest weight: 2^17.6 elements). So weights of at least this many elements are
# decoded in blocks of VECTOR_BLOCK_ELEMENTS (bench/README.md, "decode steps").
VECTOR_DECODED_LARGE_WEIGHT = 2**19
_DOT = (((1,), (0,)), ((), ()))


@dataclasses.dataclass(frozen=True)
class DotLayout:
    """How a dot_general with one weight operand maps onto (M, K) x (K, N).

    Attributes:
      weight_side: 0 if the weight is the lhs, 1 if the rhs.
      x_perm: activation axes in (free..., contraction...) order.
      x_free: the activation's free dims.
      w_perm: weight axes in (contraction..., free...) order.
      w_free: the weight's free dims.
      k: contracted size.
    """

    weight_side: int
    x_perm: tuple[int, ...]
    x_free: tuple[int, ...]
    w_perm: tuple[int, ...]
    w_free: tuple[int, ...]
    k: int

    @property
    def n(self) -> int:
        return math.prod(self.w_free)

    @property
    def m(self) -> int:
        """Rows of the activation matrix."""
        return math.prod(self.x_free)

    @property
    def w_identity(self) -> bool:
        return self.w_perm == tuple(range(len(self.w_perm)))

    @classmethod
    def of(cls, dimension_numbers, weight_side: int, x_shape, w_shape) -> "DotLayout | None":
        """None when the dot has batch dimensions (not lowered)."""
        (lc, rc), (lb, rb) = dimension_numbers
        if lb or rb:
            return None
        xc, wc = (rc, lc) if weight_side == 0 else (lc, rc)
        xf = tuple(a for a in range(len(x_shape)) if a not in xc)
        wf = tuple(a for a in range(len(w_shape)) if a not in wc)
        return cls(weight_side=weight_side, x_perm=xf + tuple(xc), x_free=tuple(x_shape[a] for a in xf),
                   w_perm=tuple(wc) + wf, w_free=tuple(w_shape[a] for a in wf),
                   k=math.prod(w_shape[a] for a in wc))

    def x_matrix(self, x: jax.Array) -> jax.Array:
        return jnp.transpose(x, self.x_perm).reshape(math.prod(self.x_free), self.k)

    def x_rows(self, param: jax.Array | None, x_ndim: int) -> jax.Array | None:
        """A keepdims per-row scale or zero point of the activation as (M, 1) or
        (1, 1); None if it varies along a contraction axis."""
        if param is None:
            return None
        param = jnp.reshape(param, jnp.shape(param) if jnp.ndim(param) == x_ndim else (1,) * x_ndim)
        moved = jnp.transpose(param, self.x_perm)
        nf = len(self.x_free)
        if any(d != 1 for d in moved.shape[nf:]):
            return None
        if all(d == 1 for d in moved.shape[:nf]):
            return moved.reshape(1, 1)
        return jnp.broadcast_to(moved, self.x_free + moved.shape[nf:]).reshape(-1, 1)

    def output(self, y: jax.Array) -> jax.Array:
        """(M, N) back to dot_general's output layout."""
        if self.weight_side == 1:
            return y.reshape(self.x_free + self.w_free)
        return y.T.reshape(self.w_free + self.x_free)


@dataclasses.dataclass(frozen=True)
class MatrixWeight:
    """A QArray weight as a (K, N) matrix in row blocks, split in column groups.

    `codes` is stacked (K // rows, rows, N) — (.., N // 2) bytes when packed,
    whose two nibbles are the two column groups (even, odd). `scales` and
    `zero_points` hold one entry per group: (1, Ns) when constant over K,
    else stacked (K // rows, rows // rows_per_scale, 1, Ns).
    """

    kind: str  # 'int', 'float', 'lut'
    qtype: str
    codes: jax.Array
    packed: bool
    scales: tuple
    zero_points: tuple
    rows: int
    rows_per_scale: int  # 0 when the scale is constant over K
    k: int
    n: int
    moved: bool  # the codes were unpacked or transposed at run time

    @property
    def blocks(self) -> int:
        return self.k // self.rows

    @property
    def groups(self) -> int:
        return 2 if self.packed else 1


def matrix_weight(q: QArray, layout: DotLayout, block_elements: int | None = None,
                  decoded: bool = True) -> MatrixWeight | None:
    """`q` as a (K, N) row-blocked matrix; None if its scale varies along
    several contraction axes (then it is not lowered). `block_elements`:
    weight elements per block (default: by the rows the activation has, and
    whether the kernel multiplies float32 values `decoded` from the codes,
    as `dot_float` does, or the int8 codes, as `dot_int` does)."""
    k, n = layout.k, layout.n
    nc = len(layout.w_perm) - len(layout.w_free)
    scale = _matrix_param(q.scale, layout, nc)
    if scale is None:
        return None
    zero_point = _matrix_param(q.zero_point, layout, nc)
    rows_per_scale = 0 if scale.shape[0] == 1 else k // scale.shape[0]
    rows = block_rows(k, n, max(rows_per_scale, 1),
                      block_elements or default_block_elements(layout.m, decoded, k * n))
    packed = q.qtype_info.values_per_byte == 2 and layout.w_identity and n % 2 == 0
    if packed:
        codes = q.qvalue.reshape(k // rows, rows, n // 2)
    elif q.qtype_info.values_per_byte == 1 and layout.w_identity:
        codes = q.qvalue.reshape(k // rows, rows, n)
    else:
        codes = jnp.transpose(q.values(), layout.w_perm).reshape(k // rows, rows, n)
    if q.qtype_info.kind == "float":  # decoded from their bits (see _decode)
        codes = lax.bitcast_convert_type(codes, jnp.uint8)

    def per_group(p):
        if p is None:
            return (None,) * (2 if packed else 1)
        if rows_per_scale:
            p = p.reshape(k // rows, rows // rows_per_scale, 1, p.shape[-1])
        if not packed:
            return (p,)
        return (p, p) if p.shape[-1] == 1 else (p[..., 0::2], p[..., 1::2])

    return MatrixWeight(kind=q.qtype_info.kind, qtype=q.qtype, codes=codes, packed=packed, scales=per_group(scale),
                        zero_points=per_group(zero_point), rows=rows, rows_per_scale=rows_per_scale, k=k, n=n,
                        moved=not layout.w_identity or (q.qtype_info.values_per_byte > 1 and not packed))


def _matrix_param(p, layout: DotLayout, nc: int):
    """A keepdims weight scale (or zero point) as (Ks, 1 or N)."""
    if p is None:
        return None
    moved = jnp.transpose(p, layout.w_perm)
    contraction, free = moved.shape[:nc], moved.shape[nc:]
    if sum(d != 1 for d in contraction) > 1:
        return None
    ks = math.prod(contraction)
    if all(d == 1 for d in free):
        return moved.reshape(ks, 1)
    return jnp.broadcast_to(moved, contraction + layout.w_free).reshape(ks, layout.n)


def default_block_elements(m: int, decoded: bool, elements: int = 0) -> int:
    """Weight elements per block for a matmul of `m` activation rows and a
    weight of `elements` elements whose blocks are `decoded` into float32
    (weight-only) or multiplied as codes."""
    if m > VECTOR_ROWS:
        return BLOCK_ELEMENTS
    if decoded and elements < VECTOR_DECODED_LARGE_WEIGHT:
        return VECTOR_DECODED_BLOCK_ELEMENTS
    return VECTOR_BLOCK_ELEMENTS


def block_rows(k: int, n: int, multiple: int, block_elements: int) -> int:
    """Rows per block: a multiple of `multiple` dividing `k`, about `block_elements` / n."""
    target = max(block_elements // max(n, 1), 1)
    if target >= k:
        return k
    best = multiple
    rows = multiple
    while rows <= k:
        if k % rows == 0 and rows <= target:
            best = rows
        rows *= 2
    return best if k % best == 0 else k


def _codes(w: MatrixWeight, block: jax.Array) -> tuple[jax.Array, ...]:
    """One block's values per column group: int8 codes, float8 values or nf4 indices."""
    if not w.packed:
        return (block,)
    return _decode.nibbles(block, signed=w.kind == "int")


def _unscaled(w: MatrixWeight, codes: jax.Array, zero_point) -> jax.Array:
    """float32 (rows, columns) of one block of one column group, before its scale."""
    if w.kind == "lut":
        return _decode.nf4_to_float32(codes)
    if w.kind == "float":
        return _decode.fp8_bits_to_float32(codes, w.qtype)
    if zero_point is not None:
        return (codes.astype(jnp.int32) - _per_row(zero_point, w)).astype(jnp.float32)
    return codes.astype(jnp.float32)


def _per_row(p, w: MatrixWeight):
    return p if not w.rows_per_scale else jnp.repeat(p.reshape(-1, p.shape[-1]), w.rows_per_scale, axis=0)




def _scan_blocks(w: MatrixWeight, x2: jax.Array, body, out_rows: int, dtype) -> tuple[jax.Array, ...]:
    """Accumulates ``body(acc, x block (M, rows), codes, scale, zero point)`` over the
    row blocks, one accumulator (out_rows, N / groups) per column group."""
    xs = x2.reshape(x2.shape[0], w.blocks, w.rows).transpose(1, 0, 2)
    per_block = w.rows_per_scale > 0

    def step(accs, sliced):
        xb, cb, sb, zb = sliced
        scales, zero_points = (sb, zb) if per_block else (w.scales, w.zero_points)
        return tuple(body(*args) for args in zip(accs, (xb,) * w.groups, _codes(w, cb), scales,
                                                  zero_points)), None

    sliced = (xs, w.codes, w.scales if per_block else None, w.zero_points if per_block else None)
    init = tuple(jnp.zeros((out_rows, w.n // w.groups), dtype) for _ in range(w.groups))
    if w.blocks == 1:
        return step(init, jax.tree.map(lambda a: a[0], sliced))[0]
    return lax.scan(step, init, sliced)[0]


def _merge(accs: tuple[jax.Array, ...]) -> jax.Array:
    return accs[0] if len(accs) == 1 else _decode.interleave(*accs)


def dot_float(x2: jax.Array, w: MatrixWeight) -> jax.Array:
    """float32 (M, N) = x2 @ dequantize(w), decoding block by block.

    A block is only converted to float32 (one pass, while in cache) and the
    scale, when constant along K, multiplies the N sums once at the end
    instead of every weight: at batch 1 this halves the time (bench/README.md).
    Per-block scales multiply the block's values.
    """

    def body(acc, xb, codes, scale, zero_point):
        values = _unscaled(w, codes, zero_point if w.kind == "int" else None)
        if w.rows_per_scale:  # each scale block of rows scaled in cache (a batched dot is 3x slower)
            grouped = values.reshape(-1, w.rows_per_scale, values.shape[-1]) * scale
            values = grouped.reshape(values.shape)
        return acc + lax.dot_general(xb, values, _DOT, preferred_element_type=jnp.float32)

    accs = _scan_blocks(w, x2.astype(jnp.float32), body, x2.shape[0], jnp.float32)
    if not w.rows_per_scale:
        accs = tuple(a * s for a, s in zip(accs, w.scales))
    return _merge(accs)


def dot_int(xq: jax.Array, x_zero_point: jax.Array | None, w: MatrixWeight,
            x_scale: jax.Array | None = None) -> jax.Array:
    """Integer matmul of int8 codes: ``sum (xq - zp) * wq`` times the weight's
    scale, float32 (M, N) — times the activation scale, it is the result.
    With `x_scale` (M, 1), the result itself: with a scale per output channel
    ``(sums * x_scale) * scale``, the order of XNNPACK's dynamic-range kernels
    and of `simulate` (`odmlq._sums`); with block scales, the blocks' scaled
    sums times `x_scale`.

    The weight is symmetric (no zero point). Accumulates in int32; a weight
    with per-block scales gets one int32 sum per block, each rescaled.
    """
    m = xq.shape[0]
    if x_zero_point is not None:  # the column sums of the codes come out as the last row
        xq = jnp.concatenate([xq, jnp.ones((1, xq.shape[1]), xq.dtype)])

    def corrected(acc):
        if x_zero_point is None:
            return acc
        return acc[..., :m, :] - x_zero_point.astype(jnp.int32) * acc[..., m:, :]

    if not w.rows_per_scale:
        def body(acc, xb, codes, scale, zero_point):
            return acc + lax.dot_general(xb, codes.astype(jnp.int8), _DOT, preferred_element_type=jnp.int32)

        accs = _scan_blocks(w, xq, body, xq.shape[0], jnp.int32)
        return _merge(tuple(_rescaled(corrected(a).astype(jnp.float32), x_scale, s) for a, s in zip(accs, w.scales)))

    def blockwise(acc, xb, codes, scale, zero_point):
        # One int32 sum per scale block of rows: a matmul batched over the blocks.
        groups = w.rows // w.rows_per_scale
        xg = xb.reshape(xb.shape[0], groups, w.rows_per_scale)
        wg = codes.astype(jnp.int8).reshape(groups, w.rows_per_scale, -1)
        partial = corrected(lax.dot_general(xg, wg, (((2,), (1,)), ((1,), (0,))), preferred_element_type=jnp.int32))
        # Added one block after another, by the function simulate adds them with (XNNPACK's order).
        return qkernels.block_sums_in_order(partial.astype(jnp.float32), scale, acc)

    y = _merge(_scan_blocks(w, xq, blockwise, m, jnp.float32))
    return y if x_scale is None else y * x_scale


def _rescaled(sums: jax.Array, x_scale: jax.Array | None, scale: jax.Array) -> jax.Array:
    """``(sums * x_scale) * scale`` (the barrier keeps XLA from multiplying the scales first),
    or ``sums * scale`` where the caller applies the input's scale."""
    if x_scale is None:
        return sums * scale
    return lax.optimization_barrier(sums * x_scale) * scale


def dot_rows(x2: jax.Array, codes: jax.Array, scale: jax.Array, x_zero_point: jax.Array | None = None,
             block_elements: int | None = None, x_scale: jax.Array | None = None) -> jax.Array:
    """float32 (M, N) = x2 . codes^T x scale, for a weight stored (N, K): a
    tied embedding table read as the output projection (``x @ table.T``).

    Blocks of whole rows of the stored weight (output channels) run in a
    `lax.scan`, each giving its own outputs, so the weight is read once in
    its stored layout (no transposed copy per call). `codes` int8 and `x2`
    float (weight-only: each block converted to float32 in cache) or int8
    codes (integer: int32 sums; `x_zero_point` folded in with the rows'
    sums). `scale`: (N, 1) or (1, 1); the activation scale is the caller's,
    or `x_scale` (M, 1), applied before `scale` (see `dot_int`).
    """
    n, k = codes.shape
    m = x2.shape[0]
    integer = jnp.issubdtype(x2.dtype, jnp.integer)
    rows = block_rows(n, k, 1, block_elements or default_block_elements(m, not integer, n * k))
    if integer and x_zero_point is not None:
        x2 = jnp.concatenate([x2, jnp.ones((1, k), x2.dtype)])
    dims = (((1,), (1,)), ((), ()))

    def step(_, block):
        if integer:
            return None, lax.dot_general(x2, block, dims, preferred_element_type=jnp.int32)
        return None, lax.dot_general(x2, block.astype(jnp.float32), dims, preferred_element_type=jnp.float32)

    blocks = codes.reshape(n // rows, rows, k)
    sums = step(None, blocks[0])[1][None] if n == rows else lax.scan(step, None, blocks)[1]
    y = jnp.transpose(sums, (1, 0, 2)).reshape(x2.shape[0], n)
    if integer:
        if x_zero_point is not None:
            y = y[:m] - x_zero_point.astype(jnp.int32) * y[m:]
        y = y.astype(jnp.float32)
    return _rescaled(y, x_scale, jnp.reshape(scale, (1, -1)))
