"""Ops rewritten into forms the backends run alike (internal; used by `_trace`).

Matmuls of a constant or a parameter matrix are written activation first.

``jax.image.resize`` (bilinear, cubic, lanczos) interpolates with
``dot_general(weights, x)``: the constant interpolation matrix is the left
operand. So does ``jnp.einsum`` where the output lists the kernel's axes
first (``'BTD,CKDH->CBTKH'``: keys and values from one ``nnx.Einsum`` kernel,
as Flax's Gemma example projects them). litert-converter 0.5.0 lowers a
dot_general's left operand to FULLY_CONNECTED's input and the right one to
its weights, so the activation became the "weights" (TRANSPOSEs and a
FULLY_CONNECTED of an activation filter at every invocation; in dynamic
range the conversion failed). Written as ``transpose(dot_general(x,
weights))`` (the same values), the constant is the weight: a FULLY_CONNECTED
reading it in its own layout, and a TRANSPOSE of its output.

A float division by a constant array of non-zero values is a multiplication
by its reciprocal (``positions / timescale`` in rotary embeddings): as an
integer DIV, the divisor was quantized like an activation, and a timescale
of 1 among ones of 3162 rounded to the zero point, which LiteRT's DIV
refuses at every invocation (XNNPACK has no integer DIV either).

Four ops that litert-converter 0.5.0 cannot carry in integers, or that the op
table would otherwise need twice, are written in forms it can
(`portable_forms`), the values unchanged:

- ``-x`` (a rotate-half rotary embedding's negation, in transformers' Llama,
  Gemma and Mistral) is ``x * -1``: the converter leaves NEG in float
  between a DEQUANTIZE and a QUANTIZE, where MUL is an int8 and int16 kernel;
- ``a ^ b`` of booleans (GPT-Neo's local attention mask) is ``a != b``:
  XOR has no LiteRT op at all (the conversion failed), NOT_EQUAL has;
- a broadcast that copies an activation a few times (``jnp.repeat`` of the
  key/value heads in grouped-query attention: transformers' Llama, Gemma,
  Mistral) is a broadcast that only adds axes of size 1 (a RESHAPE) and a
  concatenation of the copies: the converter keeps BROADCAST_TO in float,
  where CONCATENATION is an int8 kernel XNNPACK runs. Past `MAX_COPIES`
  copies (a decoder's new key written into every position of its cache by a
  select) it is that RESHAPE times a constant of ones shaped as the copied
  axes, ``(1, .., n, .., 1)``: the converter folds both broadcasts into
  MUL's own (an int8 and int16 kernel), and the file holds n ones, not n
  copies;
- ``jnp.stack`` (JAX's ``stack`` primitive; GPT-J's interleaved rotary
  embedding) is each input with an axis of size 1 added (a RESHAPE) and
  their concatenation along it: what the converter lowers it to, and one
  kind (CONCATENATION, its shared scale) for every backend;
- a gather of an activation along one axis at constant positions that repeat
  each position k times in order (``jax.image.resize(..., 'nearest')`` by an
  integer factor, as U-Nets and feature pyramids upsample) is that axis split
  in two, the copies broadcast along the new one (the broadcast's form above)
  and the two merged back; at consecutive positions it is a slice. XNNPACK
  takes no GATHER_ND: each resized axis split the graph off the delegate, and
  an int16 GATHER_ND of an activation does not convert.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from odmlq.graph._program import _Lit, _Region, _Step

# The most copies a broadcast is rewritten into as a concatenation (of that many inputs); more are a MUL.
MAX_COPIES = 16


def activation_first_matmuls(walker, steps: list) -> None:
    """Rewrites each ``dot_general(weight, activation)`` (a constant or a parameter) of `steps` (and
    of scan bodies) in place."""
    for step in list(steps):
        if isinstance(step, _Region):
            activation_first_matmuls(walker, step.body.steps)
            continue
        if not isinstance(step, _Step) or step.kind != "dot_general" or step.eqn is None:
            continue
        lhs, rhs = step.ins[:2]
        if (isinstance(lhs, _Lit) or isinstance(rhs, _Lit) or lhs not in walker.weights
                or walker.is_weight(rhs)):
            continue
        (lc, rc), (lb, rb) = step.eqn.params["dimension_numbers"]
        if lb or rb:
            continue
        _swap(walker, steps, step, lhs, rhs, tuple(lc), tuple(rc))


def _swap(walker, steps: list, step, lhs, rhs, lc, rc) -> None:
    params = step.eqn.params
    def swapped(x, c):
        y = lax.dot_general(x, c, ((rc, lc), ((), ())), precision=params.get("precision"),
                            preferred_element_type=params.get("preferred_element_type"))
        nx, nc = x.ndim - len(rc), c.ndim - len(lc)
        return jnp.transpose(y, [nx + i for i in range(nc)] + list(range(nx)))

    new = walker.walk_function(swapped, [rhs, lhs], step.outs[0], step.stack)
    if new is None:
        return
    at = steps.index(step)
    steps[at:at + 1] = new


def portable_forms(walker, steps: list) -> None:
    """Rewrites, in place, each float ``neg`` of an activation as ``x * -1``,
    each boolean ``xor`` (of constants too) as ``!=``, each broadcast that
    copies an activation as a concatenation (at most `MAX_COPIES` copies) or a
    MUL by ones (module doc), each ``stack`` of activations as a
    concatenation, each gather of an activation at constant positions that
    repeat or run consecutively as a repeat or a slice, and each float
    division by a constant array as a multiplication by its reciprocal, and
    each integer ``dot_general`` that contracts no axis as a multiplication of
    broadcasts, in scan bodies too."""
    pooled = set()  # sums of windows: divided by their counts, an average pool (`_grouping`)
    for step in list(steps):
        if isinstance(step, _Region):
            portable_forms(walker, step.body.steps)
            continue
        if isinstance(step, _Step) and step.kind == "reduce_window_sum":
            pooled.update(step.outs)
        if not isinstance(step, _Step) or step.eqn is None or step.kind not in ("neg", "xor", "broadcast_in_dim", "stack",
                                                                           "gather", "div", "dot_general"):
            continue
        dtype = step.eqn.outvars[0].aval.dtype
        operands = list(step.ins)
        constant = all(isinstance(r, _Lit) or walker.is_weight(r) for r in step.ins)
        # A negated weight is folded; a xor of constants (a mask built from a constant
        # table) is left to the converter, which folds no XOR.
        if step.kind == "neg" and not constant and jnp.issubdtype(dtype, jnp.floating):
            fn = lambda x: x * np.asarray(-1, dtype)  # noqa: E731
        elif step.kind == "xor" and dtype == np.bool_:
            fn = lambda a, b: a != b  # noqa: E731
        elif step.kind == "broadcast_in_dim" and not constant and len(step.ins) == 1:
            fn = _broadcast_form(step.eqn.params, walker.avals[step.ins[0]].shape, dtype)
            if fn is None:
                continue
        elif step.kind == "stack" and not constant and not any(isinstance(r, _Lit) for r in step.ins):
            axis = step.eqn.params["axis"]
            fn = lambda *xs: lax.concatenate([lax.expand_dims(x, (axis,)) for x in xs], axis)  # noqa: E731
        elif (step.kind == "gather" and not walker.is_weight(step.ins[0]) and len(step.ins) == 2
              and step.ins[1] in walker.constants):
            fn = _gather_form(step.eqn.params, walker.avals[step.ins[0]].shape, dtype,
                              walker.constants[step.ins[1]])
            if fn is None:
                continue
            operands = operands[:1]  # the positions are folded into the form
        elif step.kind == "dot_general" and not constant and len(step.ins) == 2:
            fn = _outer_product_form(step.eqn.params, [walker.avals[r].ndim if not isinstance(r, _Lit)
                                                       else np.ndim(r.value) for r in step.ins], dtype)
            if fn is None:
                continue
        elif (step.kind == "div" and step.ins[0] not in pooled
              and (reciprocal := _reciprocal_of(walker, step)) is not None):
            fn = lambda x: x * reciprocal  # noqa: E731
            operands = operands[:1]
        else:
            continue
        new = walker.walk_function(fn, operands, step.outs[0], step.stack)
        if new is not None:
            at = steps.index(step)
            steps[at:at + 1] = new


def _reciprocal_of(walker, step) -> np.ndarray | None:
    """The reciprocal of a float ``div``'s divisor where that is a constant array
    of non-zero finite values (not a parameter) and the dividend an activation;
    else None."""
    x, divisor = step.ins[:2]
    if (isinstance(x, _Lit) or walker.is_weight(x) or isinstance(divisor, _Lit)
            or divisor not in walker.constants):
        return None
    weight = walker.weights.get(divisor)
    if weight is not None and weight.params:
        return None
    value = walker.constants[divisor]
    if (not isinstance(value, np.ndarray) or value.size < 2 or not np.issubdtype(value.dtype, np.floating)
            or not np.all(np.isfinite(value)) or np.any(value == 0)):
        return None
    return (np.float32(1) / value.astype(np.float32)).astype(value.dtype)


def _outer_product_form(params: dict, ndims: list[int], dtype):
    """An integer ``dot_general`` that contracts no axis (``einsum('blq,blk->blqk')``
    of two masks, as BigBird builds its band mask) as a broadcast multiplication,
    exact: LiteRT has no integer BATCH_MATMUL. None for any other dot_general."""
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    if lc or rc or not jnp.issubdtype(dtype, jnp.integer):
        return None
    lf = [d for d in range(ndims[0]) if d not in lb]
    rf = [d for d in range(ndims[1]) if d not in rb]

    def outer(a, b):
        a = jnp.transpose(a, list(lb) + lf).astype(dtype)
        b = jnp.transpose(b, list(rb) + rf).astype(dtype)
        a = lax.expand_dims(a, tuple(range(a.ndim, a.ndim + len(rf))))
        b = lax.expand_dims(b, tuple(range(len(rb), len(rb) + len(lf))))
        return a * b
    return outer


def _broadcast_form(params: dict, in_shape: tuple[int, ...], dtype):
    """``broadcast_in_dim`` as a broadcast adding axes of size 1 and
    concatenations of the copies, or past `MAX_COPIES` copies (of a float
    value) a MUL by ones shaped as the copied axes; None where it copies
    nothing (or many copies of a non-float value)."""
    shape, dims = tuple(params["shape"]), tuple(params["broadcast_dimensions"])
    expanded = [1] * len(shape)
    for d, size in zip(dims, in_shape):
        expanded[d] = size
    copies = int(np.prod(shape)) // max(int(np.prod(expanded)), 1)
    if copies <= 1:
        return None
    if copies > MAX_COPIES:
        if not jnp.issubdtype(dtype, jnp.floating):
            return None
        # (1, .., n, .., 1): the MUL broadcasts both operands; the file holds n ones, not the output's size.
        ones = np.ones(tuple(size if e == 1 else 1 for size, e in zip(shape, expanded)), dtype)
        return lambda x: lax.broadcast_in_dim(x, tuple(expanded), dims) * ones

    def fn(x):
        y = lax.broadcast_in_dim(x, tuple(expanded), dims)
        for axis, size in enumerate(shape):
            if y.shape[axis] != size:
                y = jnp.concatenate([y] * size, axis=axis)
        return y

    return fn


def _gather_form(params: dict, in_shape: tuple[int, ...], dtype, indices):
    """A gather of one whole axis at constant `indices` (``jnp.take(x, idx, axis)``'s form: the
    positions on that axis of the output) as a repeat of each position k times (positions
    0, .., 0, 1, .., 1, ..: a nearest resize by an integer factor) or as a slice (consecutive
    positions); None for any other gather."""
    dn = params["dimension_numbers"]
    if (len(dn.start_index_map) != 1 or tuple(dn.collapsed_slice_dims) != tuple(dn.start_index_map)
            or dn.operand_batching_dims or dn.start_indices_batching_dims):
        return None
    axis, rank = dn.start_index_map[0], len(in_shape)
    if (tuple(params["slice_sizes"]) != tuple(1 if d == axis else n for d, n in enumerate(in_shape))
            or tuple(dn.offset_dims) != tuple(d for d in range(rank) if d != axis)):
        return None
    positions = np.asarray(indices)
    if positions.ndim != 2 or positions.shape[1] != 1 or not len(positions):
        return None
    positions, n = positions[:, 0].astype(np.int64), in_shape[axis]
    copies = len(positions) // n
    out_shape = tuple(len(positions) if d == axis else size for d, size in enumerate(in_shape))
    if copies >= 2 and len(positions) == n * copies and np.array_equal(positions, np.repeat(np.arange(n), copies)):
        split = in_shape[:axis + 1] + (1,) + in_shape[axis + 1:]
        copied = split[:axis + 1] + (copies,) + split[axis + 2:]
        broadcast = _broadcast_form({"shape": copied, "broadcast_dimensions": tuple(range(rank + 1))}, split, dtype)
        if broadcast is None:
            return None
        return lambda x: jnp.reshape(broadcast(jnp.reshape(x, split)), out_shape)
    start = int(positions[0])
    if 0 <= start and start + len(positions) <= n and np.array_equal(positions, start + np.arange(len(positions))):
        return lambda x: lax.slice_in_dim(x, start, start + len(positions), axis=axis)
    return None
