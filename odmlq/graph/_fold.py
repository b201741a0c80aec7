"""Folding an affine epilogue (an inference BatchNorm) into the matmul or
convolution before it.

The grouping merges ``conv -> (x - mean) * (scale * rsqrt(var + eps)) + bias``
into one op whose fold operands carry the BatchNorm's per-channel weights
(`Op.attributes['fold']`). As a chain of per-channel affine steps it is
``y -> y * s + t``; folding gives the kernel ``W * s`` (along its output
channels) and the bias ``b * s + t``, quantized as one convolution, as
integer kernels and LiteRT's CONV_2D compute it.

- `fold_params(graph, params)`: the params with each folded op's kernel
  scaled by ``s``: what quantized backends quantize (the float model keeps
  the original params and computes the BatchNorm as traced).
- `folded_operands(op, operands)`: an op's operands for a folded run: the
  epilogue made the identity and the folded bias placed where it is added,
  so the op computes ``conv(x, W s) + (b s + t)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from odmlq.graph._params import flat_params, replace_params
from odmlq.sharding import is_sharded

__all__ = ["affine_of", "fold_params", "folded_bias", "folded_operands", "folded_ops", "operand_values",
           "shift_output", "unfold_params"]


def folded_ops(graph) -> list:
    return [op for op in graph.ops if op.attributes.get("fold")]


def _array_module(*values):
    """numpy where every value is a float32 array on the host or one device,
    else jax.numpy: for products, sums and layouts, which are the same bits
    either way (IEEE, correctly rounded; XLA run op by op fuses no
    multiply-add), and in jax.numpy, run eagerly, compiled a program per op
    and shape (a fold: 44 programs, 2 s, for a small ResNet). Not for a
    division: XLA's float32 quotient differs from numpy's in the last bit
    (26% of random quotients on an AMD EPYC host)."""
    for v in values:
        if isinstance(v, jax.core.Tracer) or is_sharded(v):
            return jnp
        if np.dtype(getattr(v, "dtype", None) or np.asarray(v).dtype) != np.float32:
            return jnp
    return np


def _per_channel(value, axis: int, ndim: int, xp=jnp) -> jax.Array:
    """A per-channel operand (broadcastable to the output) as a (C,) vector."""
    v = xp.asarray(value)
    v = v.reshape((1,) * (ndim - v.ndim) + v.shape)
    return xp.moveaxis(v, axis, -1).reshape(-1)


def affine_of(op, operands: Sequence[Any]) -> tuple[jax.Array, jax.Array]:
    """``(s, t)``, per output channel, of the op's epilogue ``y -> y * s + t``."""
    fold = op.attributes["fold"]
    xp = jnp if any(kind == "div" for kind, _, _ in fold["steps"]) else _array_module(
        *(operands[index] for _, index, _ in fold["steps"]))
    s = t = None
    for kind, index, _ in fold["steps"]:
        w = _per_channel(operands[index], fold["channel_axis"], fold["ndim"], xp)
        if s is None:
            s, t = xp.ones_like(w), xp.zeros_like(w)
        if kind == "mul":
            s, t = s * w, t * w
        elif kind == "div":
            s, t = s / w, t / w
        elif kind == "add":
            t = t + w
        else:  # sub: the activation comes first (x - w)
            t = t - w
    return s, t


def _kernel_operand(op) -> int:
    return next(i for i, o in enumerate(op.operands) if o.role == "weight")


def folded_operands(op, operands: Sequence[Any], bias: jax.Array) -> list:
    """The op's operands for computing ``conv(x, W s) + bias`` (`bias`: the
    folded bias ``b s + t``, per channel, already on its grid): every
    epilogue step becomes the identity, and `bias` is added where the op adds
    its own bias, or by its first additive epilogue step."""
    fold = op.attributes["fold"]
    out = list(operands)
    xp = _array_module(bias, *(operands[index] for _, index, _ in fold["steps"]))
    for kind, index, _ in fold["steps"]:
        out[index] = (xp.ones_like if kind in ("mul", "div") else xp.zeros_like)(xp.asarray(operands[index]))
    carrier = next((i for i, o in enumerate(op.operands) if o.role == "bias"), None)
    sign = 1.0
    if carrier is None:
        additive = [s for s in fold["steps"] if s[0] in ("add", "sub")]
        if not additive:
            return out  # a scale alone (y * gain): no shift, and no bias to carry
        kind, carrier, _ = additive[0]
        sign = -1.0 if kind == "sub" else 1.0
    shape = jnp.shape(operands[carrier])
    axis = fold["channel_axis"] - (fold["ndim"] - len(shape))
    xp = _array_module(bias, operands[carrier])
    out[carrier] = xp.moveaxis(
        (sign * xp.asarray(bias)).reshape((1,) * (len(shape) - 1) + (-1,)), -1, axis).reshape(shape).astype(
            xp.asarray(operands[carrier]).dtype)
    return out


def folded_bias(op, operands: Sequence[Any]) -> jax.Array:
    """``b s + t`` per channel (b: the op's own bias, or 0)."""
    s, t = affine_of(op, operands)
    index = next((i for i, o in enumerate(op.operands) if o.role == "bias"), None)
    if index is None:
        return t
    return _per_channel(operands[index], -1, 1, _array_module(operands[index], s)) * s + t


def shift_output(op, y: jax.Array, shift) -> jax.Array:
    """A folded op's output `y` with a per-channel `shift` added (what adding
    it to the folded bias gives)."""
    fold = op.attributes["fold"]
    shape = [1] * jnp.ndim(y)
    shape[fold["channel_axis"] - (fold["ndim"] - jnp.ndim(y))] = -1
    return y + jnp.asarray(shift, y.dtype).reshape(shape)


def fold_params(graph, params: Any, kernels=None) -> Any:
    """`params` with each folded op's kernel scaled by its epilogue's ``s``
    along the kernel's output channels (the float model's BatchNorm folded
    in). With `kernels` (parameter paths), only the ops whose kernel is one
    of them: a BatchNorm is folded where its op's kernel is quantized, and
    computed as traced elsewhere. A graph without folds gets `params` back."""
    factors = _fold_factors(graph, params, kernels)
    if not factors:
        return params
    values = flat_params(params)
    return replace_params(params, {p: _scaled(values[p], s, axis) for p, (s, axis) in factors.items()})


def _scaled(kernel, s, axis: int):
    """`kernel` times `s` along `axis`, in the kernel's dtype."""
    xp = _array_module(kernel, s)
    kernel = xp.asarray(kernel)
    return (kernel * _along(s, axis, kernel.ndim, xp)).astype(kernel.dtype)


def unfold_params(graph, params: Any, folded: Mapping[str, Any]) -> Any:
    """`params` with each weight in `folded` (parameter path -> its values as
    `fold_params` gives them) set so that folding gives those values back:
    a folded kernel divided by its epilogue's ``s``, any other as it is."""
    factors = _fold_factors(graph, params, set(folded))
    values = flat_params(params)
    new = {}
    for p, v in folded.items():
        v, dtype = jnp.asarray(v), jnp.asarray(values[p]).dtype
        if p in factors:
            s, axis = factors[p]
            v = v / _along(s, axis, v.ndim)
        new[p] = v.astype(dtype)
    return replace_params(params, new)


def _along(s: jax.Array, axis: int, ndim: int, xp=jnp) -> jax.Array:
    shape = [1] * ndim
    shape[axis] = -1
    return xp.asarray(s).reshape(shape)


def _fold_factors(graph, params: Any, kernels) -> dict[str, tuple[jax.Array, int]]:
    """Kernel parameter path -> (the ``s`` folding multiplies it by, the
    kernel's output channel axis)."""
    ops = [op for op in folded_ops(graph)
           if kernels is None or op.operands[_kernel_operand(op)].param in kernels]
    if not ops:
        return {}
    operands = operand_values(graph, params, {op.id for op in ops})
    out = {}
    for op in ops:
        kernel = op.operands[_kernel_operand(op)]
        s, _ = affine_of(op, operands[op.id])
        (axis,) = kernel.channel_axes
        out[kernel.param] = (s, axis)
    return out


def operand_values(graph, params: Any, op_ids: set[str]) -> dict[str, list]:
    """The operands the ops read (weights and their derived values): what is
    read from parameters depends on them only. An activation operand (role
    ``'input'``) is None.

    Only traced for the inputs (``jax.make_jaxpr``, never compiled), the
    steps that read no input computed at once (`Graph.evaluate`'s
    `constant_steps`): run on zeros op by op, a model's activation ops each
    compiled a program of their own (a small ResNet: 42 programs, 2 s).
    Where an operand other than an activation depends on the inputs after
    all, or the params are traced (a training step), the model runs on
    zeros, and the compiler keeps only what the params feed."""
    found: dict[str, list] = {}

    def on_op(op_id, compute, *operands):
        if op_id in op_ids:
            found[op_id] = list(operands)
        return compute(*operands)

    def values() -> dict[str, list]:
        return {op_id: [None if o.role == "input" else x if isinstance(x, jax.core.Tracer) else np.asarray(x)
                        for o, x in zip(graph.op(op_id).operands, operands)]
                for op_id, operands in found.items()}

    inputs = [np.zeros(graph.edges[e].shape, graph.edges[e].dtype) for e in graph.inputs]
    if not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(params)):
        jax.make_jaxpr(lambda *xs: graph.evaluate(params, *graph.structured_inputs(list(xs)), on_op=on_op,
                                                  constant_steps=True))(*inputs)
        traced = values()
        if not any(isinstance(x, jax.core.Tracer) for operands in traced.values() for x in operands):
            return traced
        found.clear()
    graph.evaluate(params, *graph.structured_inputs(inputs), on_op=on_op)
    return values()
