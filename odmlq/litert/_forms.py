"""Ops written in forms litert-converter 0.5.0 lowers to LiteRT's integer (or
XNNPACK's) kernels, the values unchanged (internal; used by `_annotate`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from odmlq.graph import evaluate_replacing, gathered_rows_axes, scattered_row_dims, scattered_rows_axis
from odmlq.litert.spec import pool_pads_with_zeros
from odmlq.qtypes import qtype as lookup_qtype
from odmlq.scales import TensorScale


def gelu_erf(x):
    """The exact GELU as x/2 (1 + erf(x / sqrt 2))."""
    return x * 0.5 * (1.0 + jax.lax.erf(x * np.float32(np.sqrt(0.5))))


EXPONENTIAL_LINEAR = frozenset({"elu", "selu", "celu"})


def exponential_linear(compute, shape: tuple) -> Callable | None:
    """ELU, SELU or CELU kept in float as ``s (x - m) + a (exp(m / b) - 1)``,
    ``m = min(x, 0)``: MINIMUM, SUB, EXP and ADD, each an XNNPACK kernel.
    litert-converter 0.5.0 writes jax.nn's ``where(x > 0, ...)`` as GREATER
    and SELECT, which XNNPACK does not run: each such op split the graph in
    three partitions. s, a and b (the function's slope, ``alpha`` and, for
    CELU, its divisor) are read from `compute`, the op as traced on inputs of
    `shape`, and the form is used only where it gives `compute`'s values on
    -30..30 (None: it does not)."""
    size = max(int(np.prod(shape)), 1)

    def f(values):
        values = np.asarray(values, np.float32).ravel()
        out = []
        for start in range(0, len(values), size):  # the op takes arrays of its traced shape only
            chunk = values[start:start + size]
            with jax.ensure_compile_time_eval():  # evaluated now, not staged into the model's trace
                y = compute(jnp.asarray(np.resize(chunk, shape)))[0]
            out.append(np.asarray(y, np.float64).ravel()[:len(chunk)])
        return np.concatenate(out)

    slope, alpha, at_minus_one = f([1.0, -1e4, -1.0])
    alpha = -alpha
    if not (np.isfinite(slope) and slope > 0 and np.isfinite(alpha) and alpha > 0 and -1 < at_minus_one / alpha < 0):
        return None
    divisor = float(-1.0 / np.log1p(at_minus_one / alpha))
    divisor = 1.0 if abs(divisor - 1.0) < 1e-5 else divisor
    s, a, b = np.float32(slope), np.float32(alpha), np.float32(divisor)

    def form(x):
        m = jnp.minimum(x, np.float32(0))
        linear = x - m if s == 1 else (x - m) * s
        return linear + a * (jnp.exp(m if b == 1 else m / b) - np.float32(1))

    grid = np.linspace(-30, 30, 1201, dtype=np.float32)
    with jax.ensure_compile_time_eval():
        same = np.allclose(np.asarray(form(grid)), f(grid), rtol=1e-5, atol=1e-6)
    return form if same else None


def reciprocal_scale(ts: TensorScale, reciprocal: float) -> TensorScale:
    """A scalar's quantization in the divisor's qtype, at its largest integer (exact)."""
    qt = ts.qtype
    return dataclasses.replace(ts, scale=np.asarray(abs(reciprocal) / qt.qmax, np.float32),
                               zero_point=None if ts.zero_point is None else np.zeros_like(ts.zero_point))


def max_pool_padded_with_zeros(op, x: jax.Array) -> jax.Array:
    """A padded max pool of non-negative values as PAD (zeros) and a VALID
    MAX_POOL_2D: the same maximum, with int16 kernels for both (the
    converter pads an int16 pool with PADV2, which has none)."""
    padded = jnp.pad(x, [tuple(p) for p in op.attributes["padding"]])
    return jax.lax.reduce_window(padded, -jnp.inf, jax.lax.max, tuple(op.attributes["window"]),
                                 tuple(op.attributes["strides"]), "VALID")


def avg_pool_padded_with_zeros(op, x: jax.Array) -> jax.Array:
    """An average pool that counts its padding (``count_include_pad``) as PAD
    (zeros) and a VALID AVERAGE_POOL_2D: the same sums and divisor. Handed
    over as it is traced, litert-converter 0.5.0 leaves a float
    STABLEHLO_REDUCE_WINDOW and MUL."""
    padded = jnp.pad(x, [tuple(p) for p in op.attributes["padding"]])
    total = jax.lax.reduce_window(padded, 0.0, jax.lax.add, tuple(op.attributes["window"]),
                                  tuple(op.attributes["strides"]), "VALID")
    return total / float(op.attributes["window_size"])


def gathered_in_fill_mode(compute, inputs: list) -> list:
    """A gather of a table in mode 'clip' or 'promise_in_bounds' (``table[ids]``,
    ``jnp.take(..., mode='clip')``) as its start indices clamped, then a gather
    in mode 'fill': the rows it reads for every index, in bounds or not (XLA
    clamps out-of-bounds starts; clamped, none is out of bounds to fill).

    litert-converter 0.5.0 takes no int16 GATHER_ND in those modes ('tfl.gather_nd'
    op operand #0 must be ... 8-bit signless integer) and makes one in mode 'fill'."""
    return _with_gathers_replaced(compute, inputs, {"CLIP", "PROMISE_IN_BOUNDS"}, _clamped_fill_gather)


def _with_gathers_replaced(compute, inputs: list, modes: set[str], replacement) -> list:
    """The op with each gather in one of `modes` computed by ``replacement(eqn, ins)``."""
    closed = jax.make_jaxpr(compute)(*inputs)
    gathers = {i: replacement for i, e in enumerate(closed.jaxpr.eqns) if e.primitive.name == "gather"
               and getattr(e.params["mode"], "name", "") in modes}
    return evaluate_replacing(closed, inputs, gathers) if gathers else compute(*inputs)


def gathered_without_fill(compute, inputs: list) -> list:
    """A quantized table's gather in mode 'fill' (nn.Embed, jnp.take's default)
    as a gather of the indices as they are: the same rows for every index in
    bounds, and no bounds check.

    litert-converter 0.5.0 lowers the fill as a bounds check (6 ops XNNPACK does
    not run) and a SELECT_V2 of the rows and the fill value, but its GATHER_ND
    reads the unchecked indices, so LiteRT's interpreter fails an out-of-bounds
    index at invocation either way (measured: 'gather_nd index out of bounds'). It
    also makes one constant of the fill values of every table's gather, quantized
    at one table's scale: in dynamic range the other table's rows were requantized
    to it (Flax's WMT Transformer, 1 LSB off and refused by verification)."""
    return _with_gathers_replaced(compute, inputs, {"FILL_OR_DROP"}, _gather_in_bounds)


def scattered_as_sums(compute, inputs: list, qtype: str | None = None, mark=None) -> list | None:
    """A scatter-add of whole rows along one axis (``jax.ops.segment_sum``,
    ``x.at[ids].add(rows)``: a graph network's messages summed per node) as
    sums over a one-hot match of the indices: ``operand + (ids == s) @ rows``,
    a matmul for float rows, MUL and SUM for integers. Out-of-range indices
    match no row and are dropped (jax's mode 'fill'; mode 'clip' clamps them
    first), duplicates summed, as XLA's scatter does.

    litert-converter 0.5.0 writes a scatter-add as STABLEHLO_SCATTER with its
    sum as a separate subgraph holding an ADD, which LiteRT's kernel refuses
    when the model is loaded ("Only update, Add, Multiply, Maximum and Minimum
    operations are currently supported"): no model summing by index loaded.

    Quantized (`qtype`: the output's): the one-hot matrix is marked with
    `mark` in that qtype at scale 1 / qmax, zero point 0 (0 and 1 exact), so
    that the matmul is an integer FULLY_CONNECTED of it and the quantized
    rows: each sum rounded once, at the output's scale. None: `compute` holds no such scatter."""
    closed = jax.make_jaxpr(compute)(*inputs)
    one = None if qtype is None else _one_exact(qtype)
    found = {i: functools.partial(_summed_rows, one=one, mark=mark) for i, e in enumerate(closed.jaxpr.eqns)
             if e.primitive.name == "scatter-add" and scattered_rows_axis(e) is not None}
    return evaluate_replacing(closed, inputs, found) if found else None


def _one_exact(qtype: str) -> TensorScale:
    """A symmetric quantization in `qtype` holding 0 and 1 exactly (1 as its largest code)."""
    top = float(lookup_qtype(qtype).qmax)
    return TensorScale(qtype=qtype, scale=np.asarray(1.0 / top, np.float32), zero_point=np.zeros((), np.int64))


def _summed_rows(eqn, ins, one: TensorScale | None = None, mark=None) -> list:
    operand, indices, updates = ins
    axis = scattered_rows_axis(eqn)
    size = operand.shape[axis]
    ids = indices.reshape(-1)
    if getattr(eqn.params["mode"], "name", "") == "CLIP":
        ids = jnp.clip(ids, 0, size - 1)
    dims = scattered_row_dims(eqn)
    rows = jnp.moveaxis(updates, dims, list(range(len(dims)))).reshape(ids.shape[0], -1)
    hit = ids[None, :] == jnp.arange(size, dtype=ids.dtype)[:, None]
    if not jnp.issubdtype(rows.dtype, jnp.floating):
        sums = jnp.sum(jnp.where(hit[:, :, None], rows[None], jnp.zeros((), rows.dtype)), axis=1)
    else:
        matrix = hit.astype(rows.dtype) if one is None else mark(hit.astype(rows.dtype), one)
        if one is not None and one.qtype.bits == 8:
            # int8: the rows as FULLY_CONNECTED's input, the one-hot matrix (S, N)
            # as its weight (out, in): an integer weight needs zero point 0, which
            # the matrix has and an activation's grid mostly has not. int16: both
            # operands int16 (an int8 matrix fails LiteRT's int16x8 kernel at load).
            sums = jax.lax.dot_general(rows, matrix, (((0,), (1,)), ((), ()))).T
        else:
            sums = jnp.matmul(matrix, rows)
    window = [d for i, d in enumerate(operand.shape) if i != axis]
    sums = jnp.moveaxis(sums.reshape([size] + window), 0, axis).astype(operand.dtype)
    if not isinstance(operand, jax.core.Tracer) and not np.any(np.asarray(operand)):
        return [sums]  # segment_sum's zeros: nothing to add
    return [operand + sums]


def gathered_as_one_hot(compute, inputs: list, rows_ts: TensorScale, mark) -> list | None:
    """An int16 gather of an activation's whole rows (`graph.gathered_rows_axes`:
    ``nodes[senders]``, CLIP's ``x[jnp.arange(b), ids.argmax(-1)]``) as a
    one-hot match of each index, flattened over the indexed axes, times the
    rows: an int16 matmul whose every output is one row's value times 1,
    exact at the rows' scale (the gather's output keeps it). litert-converter
    0.5.0 makes no int16 GATHER_ND ('tfl.gather_nd' op operand #0 must be ...
    8-bit). Modes 'clip' and 'promise_in_bounds' clamp each index first (as
    XLA does); in mode 'fill' an index out of bounds matches no row: zeros,
    where a float gather fills NaN, which no integer holds. `rows_ts`: the
    rows' scale, the gather's output's too. None: `compute` holds no such gather."""
    closed = jax.make_jaxpr(compute)(*inputs)
    found = {i: functools.partial(_one_hot_rows, rows_ts=rows_ts, mark=mark) for i, e in enumerate(closed.jaxpr.eqns)
             if e.primitive.name == "gather" and gathered_rows_axes(e) is not None}
    return evaluate_replacing(closed, inputs, found) if found else None


def _one_hot_rows(eqn, ins, rows_ts: TensorScale, mark) -> list:
    operand, indices = ins
    axes, dn = gathered_rows_axes(eqn), eqn.params["dimension_numbers"]
    batching = tuple(getattr(dn, "operand_batching_dims", ()))  # a gather under vmap: one per batch
    index_batching = tuple(getattr(dn, "start_indices_batching_dims", ()))
    sizes = np.asarray([operand.shape[a] for a in axes], np.int64)
    # Indices as (batches, picks, axes) and the operand as (batches, rows, row).
    others = [d for d in range(indices.ndim - 1) if d not in index_batching]
    ids = jnp.transpose(indices, (*index_batching, *others, indices.ndim - 1))
    count, batches = int(np.prod(sizes)), int(np.prod([operand.shape[d] for d in batching]))
    ids = ids.reshape(batches, -1, len(axes))
    inside = None
    if getattr(eqn.params["mode"], "name", "") in ("CLIP", "PROMISE_IN_BOUNDS"):
        ids = jnp.clip(ids, 0, (sizes - 1).astype(ids.dtype))
    else:
        inside = jnp.all((ids >= 0) & (ids < sizes.astype(ids.dtype)), axis=-1)
    strides = np.cumprod(np.concatenate([[1], sizes[::-1][:-1]]))[::-1].astype(np.dtype(ids.dtype))
    flat = jnp.sum(ids * strides, axis=-1)
    if inside is not None:
        flat = jnp.where(inside, flat, -1)
    rest = [d for d in range(operand.ndim) if d not in (*batching, *axes)]
    rows = jnp.transpose(operand, (*batching, *axes, *rest)).reshape(batches, count, -1)
    # (count, picks) per batch, as `_summed_rows` matches: the other orientation
    # became a float ONE_HOT and a QUANTIZE.
    positions = jnp.arange(count, dtype=flat.dtype)
    # 1 as code 2^14: the kernel's rescaling by 2^-14 is exact (at 1/32767 it was 1 LSB off).
    one = TensorScale(qtype="int16", scale=np.asarray(2.0 ** -14, np.float32), zero_point=np.zeros((), np.int64))
    # A batch axis even of 1: as a 2-D matmul, a one-hot matrix of constant indices
    # (BigBird's blocks, a resize) was transposed at every invocation.
    hit = (positions[None, :, None] == flat[:, None, :]).astype(rows.dtype)
    picked = jax.lax.dot_general(mark(hit, one), rows, (((1,), (1,)), ((0,), (0,))))
    # The gather's output: the whole axes at `offset_dims`, the indices' batch axes elsewhere, in order.
    index_dims = [*index_batching, *others]
    shape = (*(indices.shape[d] for d in index_dims), *(operand.shape[d] for d in rest))
    rank = len(index_dims) + len(rest)
    slots = [p for p in range(rank) if p not in dn.offset_dims]  # output positions of the indices' axes, in order
    source = {slots[d]: index_dims.index(d) for d in range(len(slots))}
    source |= {p: len(index_dims) + j for j, p in enumerate(dn.offset_dims)}
    order = [source[p] for p in range(rank)]
    if picked.shape == shape and order == sorted(order):
        return [picked]
    # Laid out after the matmul: litert-converter 0.5.0 moves a reshape or transpose
    # past an int16 ADD that reads it, which then wrote at the layout's scale, not its
    # own (6,743 LSB off); after a same-scale MAXIMUM it stays in place (LiteRT's
    # MAXIMUM takes at most 5 axes: BigBird's 6-axis blocks are read as they are).
    picked = jnp.transpose(mark(picked, rows_ts).reshape(shape), order)
    return [separated(picked, rows_ts, mark) if picked.ndim <= 5 else picked]


def _gather_in_bounds(eqn, ins) -> list:
    return [_regathered(eqn, *ins, jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)]


def _clamped_fill_gather(eqn, ins) -> list:
    table, indices = ins
    params = eqn.params
    # jax's gather reads its index vectors along the last axis, one start per
    # `start_index_map` axis; a start past `size - slice size` reads past the end.
    top = np.asarray([table.shape[d] - params["slice_sizes"][d] for d in params["dimension_numbers"].start_index_map],
                     np.dtype(indices.dtype))
    clamped = jnp.clip(indices, np.zeros_like(top), top)
    return [_regathered(eqn, table, clamped, jax.lax.GatherScatterMode.FILL_OR_DROP)]


def _regathered(eqn, table, indices, mode) -> jax.Array:
    """`eqn`'s gather of `table` at `indices` in another mode."""
    params = eqn.params
    return jax.lax.gather(table, indices, params["dimension_numbers"], params["slice_sizes"],
                          indices_are_sorted=params["indices_are_sorted"], unique_indices=params["unique_indices"],
                          mode=mode)


def _int16(top: float) -> TensorScale:
    """A symmetric int16 quantization whose largest code is `top`."""
    return TensorScale(qtype="int16", scale=np.asarray(max(top, 1e-30) / 32767.0, np.float32))


def concatenated_by_padded_sums(parts: list, axis: int, ts: TensorScale, mark) -> jax.Array:
    """An int16 concatenation along `axis` as PADs (zeros) and ADDs:
    litert-converter 0.5.0 takes no int16 operand for CONCATENATION, and has
    int16 kernels for both.

    The parts share the output's scale (the plan's SHARED constraint) and
    int16's zero point is 0, so each sum
    adds a value to zeros: exact. The halves are joined pairwise (a balanced
    tree), so every value is padded and added once per level: about log2(n)
    passes over the output, not n. `mark` quantizes each padded part at `ts`."""
    def join(parts):
        if len(parts) == 1:
            return parts[0]
        half = len(parts) // 2
        left, right = join(parts[:half]), join(parts[half:])
        low, high = [(0, 0)] * np.ndim(left), [(0, 0)] * np.ndim(left)
        low[axis], high[axis] = (0, right.shape[axis]), (left.shape[axis], 0)
        with jax.named_scope("join"):
            return mark(jnp.pad(left, low), ts) + mark(jnp.pad(right, high), ts)

    return join(list(parts))


def added_at_one_shape(op, inputs: list, shape, input_scales: list, mark) -> jax.Array:
    """An int16 ADD or SUB whose operands have other shapes than its output:
    litert-converter 0.5.0 takes int16 ADD operands of one shape only ('tfl.add'
    op failed to verify that operands should have valid shapes). An activation
    is broadcast first by an int16 MUL by ones, at its own scale (the product
    of a code and 1 rounds back to the code: exact); a constant is stored at
    the output's shape (`spec.int16_full_shape_operand`). The attention
    masks of transformers are added so: scores (b, h, q, k) + mask (b, 1, 1, k)."""
    full = []
    for operand, x, ts in zip(op.operands, inputs, input_scales):
        # (A scalar is added as the op adds it.)
        if np.ndim(x) and tuple(np.shape(x)) != tuple(shape):
            x = jnp.reshape(x, (1,) * (len(shape) - np.ndim(x)) + tuple(np.shape(x)))
            if operand.role == "input" and ts is not None:
                ones = np.ones([n if m == 1 else 1 for m, n in zip(x.shape, shape)], np.float32)
                one = _int16(1.0)
                with jax.named_scope("broadcast"):
                    x = mark(x * mark(one.fake_quant(jnp.asarray(ones)), one), ts)
            else:
                x = jnp.broadcast_to(x, shape)
        full.append(x)
    return full[0] + full[1] if op.kind == "add" else full[0] - full[1]


def pool_as_depthwise_conv(op, x: jax.Array, mark) -> jax.Array:
    """An NHWC average pool as a depthwise convolution with weights 1/n.

    XNNPACK does not take int8 AVERAGE_POOL_2D, so a model with one runs in
    several delegate partitions; the depthwise convolution it takes. A pool
    that counts its padding pads with zeros first (PAD). The
    weight 1/n is stored as 127 with scale 1/(127 n), exactly, per channel;
    `mark(kernel, ts, axis)` quantizes it.
    """
    _, h, w, _ = op.attributes["window"]
    if pool_pads_with_zeros(op):
        x = jnp.pad(x, [tuple(p) for p in op.attributes["padding"]])
    channels = x.shape[-1]
    n = h * w
    scale = np.full((1, 1, 1, channels), 1.0 / (127.0 * n), np.float32)
    weight = TensorScale(qtype="int8", scale=scale, zero_point=None, scale_axes=(3,), narrow_range=True)
    kernel = np.full((1, h, w, channels), 127.0, np.float32) * scale  # native layout (1, H, W, C)
    kernel = mark(jnp.asarray(kernel), weight, 3)
    return jax.lax.conv_general_dilated(
        x, jnp.transpose(kernel, (1, 2, 0, 3)), tuple(op.attributes["strides"][1:3]), "VALID",
        dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=channels)


def gelu_in_int16(x: jax.Array, in_ts: TensorScale, mark) -> jax.Array:
    """GELU from int16 kernels: ``x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))``
    (tanh's form, as jax.nn.gelu's default writes it) as MUL, ADD and
    LOGISTIC; LiteRT has no int16 GELU. Each intermediate's scale follows from
    the input's range X = 32767 * its step (x^2 up to X^2, ...): no calibration.
    Within the op table's tolerance of simulate's GELU (exact or tanh form)
    for inputs up to about 20 (the x^3 term's step grows as X^3)."""
    top = float(np.max(in_ts.scale)) * 32767.0
    c = np.float32(2.0 * np.sqrt(2.0 / np.pi))
    inner_top = top + 0.044715 * top ** 3

    def constant(value):
        ts = _int16(abs(value))
        return mark(ts.fake_quant(jnp.asarray(np.float32(value))), ts)

    with jax.named_scope("gelu_int16"):
        square = mark(x * x, _int16(top * top))
        cube = mark(square * x, _int16(top ** 3))
        inner = mark(x + mark(cube * constant(0.044715), _int16(0.044715 * top ** 3)), _int16(inner_top))
        scaled = mark(inner * constant(c), _int16(float(c) * inner_top))
        gate = mark(jax.nn.sigmoid(scaled), TensorScale(qtype="int16", scale=np.asarray(1.0 / 32768.0, np.float32)))
        return x * gate


def rsqrt_in_pieces(x: jax.Array, in_ts: TensorScale, pieces, mark) -> jax.Array:
    """An int16 1/sqrt(x) as `_tables.RsqrtPieces` computes it: per piece a
    same-scale MAXIMUM (the last piece: MINIMUM) with its bound, a QUANTIZE to
    the piece's step (saturating at its upper bound) and an RSQRT over the
    piece's own table; the pieces ADDed, then the constant subtracted (a
    full-shape int16 operand: litert-converter takes only same-shaped int16
    ADD operands). The same-scale op before each QUANTIZE also keeps the
    converter from folding it into x's producer, which the other pieces read."""
    steps = pieces.piece_scales(float(np.max(in_ts.scale)))
    bounds, last = pieces.bounds, len(pieces.bounds)

    def on_input_grid(value):
        with jax.ensure_compile_time_eval():
            bound = in_ts.fake_quant(jnp.asarray(np.float32(value)))
        return mark(bound, in_ts)

    with jax.named_scope("rsqrt_pieces"):
        total, top = None, 0.0
        for i, step in enumerate(steps):
            clip = jnp.minimum if i == last else jnp.maximum
            clamped = mark(clip(x, on_input_grid(bounds[min(i, last - 1)])), in_ts)
            if i > 0:
                clamped = mark(clamped, TensorScale(qtype="int16", scale=np.asarray(step, np.float32)))
            piece = mark(jax.lax.rsqrt(clamped), _int16(pieces.tops[i]))
            top += pieces.tops[i]
            total = piece if total is None else mark(total + piece, _int16(top))
        offset = _int16(pieces.constant)
        with jax.ensure_compile_time_eval():
            constant = offset.fake_quant(jnp.full(x.shape, -pieces.constant, jnp.float32))
        return total + mark(constant, offset)


def separated(x: jax.Array, source: TensorScale, mark, variant: int = 0) -> jax.Array:
    """`x` (quantized at `source`, per tensor) after a same-scale MAXIMUM with
    its lowest code: the identity on its grid. litert-converter
    folds a QUANTIZE of a quantized tensor into the op producing it (which then
    reads one qtype and writes another), but not through a same-scale op.

    `variant` picks one of equal forms: a MAXIMUM with the lowest code or a
    MINIMUM with the highest, the constant of rank 0 to ``x.ndim``, after as
    many MAXIMUMs again as the forms run out. The converter merges equal ops on
    one tensor, and one same-scale op read by two QUANTIZEs of other scales
    leaves the second a float DEQUANTIZE and QUANTIZE: an edge (or the same
    slice of it) read by two concatenations at their own scales."""
    step = float(np.asarray(source.scale).reshape(()))
    zero = 0.0 if source.zero_point is None else float(np.asarray(source.zero_point).reshape(()))
    forms = 2 * (np.ndim(x) + 1)
    for _ in range(variant // forms):
        x = separated(x, source, mark)
    variant %= forms
    # The lowest code, marked at the edge's own scale: an unmarked float constant
    # left the MAXIMUM in float where the producer read a QUANTIZE of a float op.
    code = source.qtype.qmax if variant % 2 else source.qtype.qmin
    with jax.ensure_compile_time_eval():
        bound = source.fake_quant(jnp.asarray(np.full((1,) * (variant // 2), (code - zero) * step, np.float32)))
    return mark((jnp.minimum if variant % 2 else jnp.maximum)(x, mark(bound, source)), source)
