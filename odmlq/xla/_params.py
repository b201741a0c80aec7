"""quantize_params: a model's float weights turned into the QArrays its Plan asks for.

Every weight that the plan quantizes becomes a `QArray` with exactly the
integers `odmlq.simulate` uses (the same `odmlq.scales` weight scale and the
same `odmlq.qarray.quantize`); every other leaf is kept as it is. No model is
run, so weights can be quantized one subtree at a time as they are loaded, or
described abstractly (`jax.ShapeDtypeStruct` leaves in, abstract QArrays out),
and the float weights of a large model never sit in memory together.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from odmlq.graph import fold_params, folded_ops, param_path, params_tree
from odmlq.errors import PlanError
from odmlq.qarray import QArray, scale_shape
from odmlq.scales import TensorScale, algorithm_applies, compute_scales, weight_scale
from odmlq.qarray import packed_size
from odmlq.sharding import is_sharded, quantized_placement

__all__ = ["quantize_params", "weight_specs", "flat_leaves", "check_paths", "weight_scale_of"]


def is_leaf(x: Any) -> bool:
    return isinstance(x, QArray)


def flat_leaves(params: Any) -> tuple[list[tuple[str, Any]], Any]:
    """``([(param path, leaf)], treedef)`` with QArrays as leaves."""
    params = params_tree(params)
    leaves, tree = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_leaf)
    return [(param_path(path), leaf) for path, leaf in leaves], tree


def weight_specs(plan) -> dict[str, Any]:
    """Parameter path -> the `QuantSpec` the plan gives it (see `Plan.weight_specs`)."""
    return plan.weight_specs()


def check_paths(given: Mapping[str, Any], plan, *, partial: bool, what: str = "params") -> None:
    """Checks parameter paths and shapes against the plan's traced parameters.

    Raises:
      PlanError: listing the missing paths (unless `partial`), the extra
        paths, and the leaves whose shape differs from the traced one.
    """
    expected = plan.graph.params
    missing = [] if partial else sorted(set(expected) - set(given))
    extra = sorted(set(given) - set(expected))
    shape = {p: tuple(given[p].shape if is_leaf(given[p]) else np.shape(given[p])) for p in set(given) & set(expected)}
    shapes = [f"{p}: {shape[p]} (plan: {expected[p][0]})" for p in sorted(shape)
              if shape[p] != tuple(expected[p][0])]
    if not (missing or extra or shapes):
        return
    parts = []
    if missing:
        parts.append(f"missing {_listing(missing)}")
    if extra:
        parts.append(f"not in the plan {_listing(extra)}")
    if shapes:
        parts.append(f"of another shape {_listing(shapes)}")
    raise PlanError(
        f"The {what} do not match the plan of {plan.graph.model_name}: " + "; ".join(parts) + ". "
        "Pass the params the plan was traced with (or, for one part of them, "
        "quantize_params(subtree, plan, prefix='its/path')).")


def _listing(items: list[str], limit: int = 12) -> str:
    shown = ", ".join(repr(i) for i in items[:limit])
    return f"({len(items)}): {shown}" + (f", ... {len(items) - limit} more" if len(items) > limit else "")


def quantize_params(params: Any, plan, *, prefix: str | None = None, calibration=None) -> Any:
    """Quantizes the weights of `params` as `plan` says, without running the model.

    Args:
      params: the float params (Linen variables, an NNX module or state, a
        dict), or any part of them with `prefix`. Leaves may be arrays (numpy
        or jax) or `jax.ShapeDtypeStruct`s (then the QArrays are abstract too:
        their leaves are `ShapeDtypeStruct`s, for planning memory or loading).
      plan: the Plan.
      prefix: where `params` sits in the model's params (``'layers/3'``;
        ``''`` for a partial tree laid out like the whole one). With a
        prefix, parameters the subtree lacks are fine; without one, `params`
        must hold every parameter of the plan.

    Returns:
      `params` with each quantized weight replaced by its `QArray` (int8,
      packed int4 / nf4 bytes, float8 ...), other leaves unchanged. QArray
      leaves are already quantized and are kept.

    Raises:
      PlanError: paths missing from or not in the plan, or leaves of another
        shape than traced (all listed in one message).
      CalibrationError: a weight's algorithm finds no statistics of its inputs
        in `calibration`.

    Example:
      >>> plan = odmlq.plan(model, [odmlq.Rule('.*', weight_qtype='int8')], x)
      >>> qparams = odmlq.quantize_params(variables, plan)
      >>> layer = odmlq.quantize_params(load('layers/3'), plan, prefix='layers/3')
    """
    specs = weight_specs(plan)
    rounded = _rounded(params, plan, prefix, calibration)
    params = _folded(params, plan, prefix)
    leaves, tree = flat_leaves(params)
    base = "" if not prefix else prefix.strip("/") + "/"
    paths = [base + p if p else prefix.strip("/") for p, _ in leaves]
    check_paths(dict(zip(paths, (x for _, x in leaves))), plan, partial=prefix is not None)
    out = []
    for path, (_, leaf) in zip(paths, leaves):
        spec = specs.get(path)
        if spec is None or is_leaf(leaf):
            out.append(leaf)
        elif isinstance(leaf, jax.ShapeDtypeStruct):
            out.append(abstract_qarray(tuple(leaf.shape), spec, getattr(leaf, "sharding", None)))
        elif path in rounded:
            ts, values = rounded[path]
            out.append(ts.quantize(values))
        elif is_sharded(leaf):  # read shard by shard, quantized where it lies (odmlq.sharding)
            out.append(weight_scale(leaf, spec).quantize(leaf))
        else:
            out.append(weight_scale(np.asarray(leaf, np.float32), spec).quantize(leaf))
    return jax.tree_util.tree_unflatten(tree, out)


def _rounded(params: Any, plan, prefix: str | None, calibration) -> dict[str, tuple[TensorScale, Any]]:
    """Parameter path -> (scale, values) of each weight a weight algorithm
    rounds, as `odmlq.compute_scales` rounds it (against the calibration's
    statistics of its inputs, and the rounding noise of its input edge)."""
    if prefix is None:  # quantized leaves (a model's params reused by another method) are kept
        done = {path for path, leaf in flat_leaves(params)[0] if is_leaf(leaf)}
    else:
        done = set()
    if not any(algorithm_applies(p, spec, calibration) for p, spec in weight_specs(plan).items() if p not in done):
        return {}
    specs = weight_specs(plan)
    sharded = [path for path, leaf in flat_leaves(params)[0] if path in specs and is_sharded(leaf)
               and algorithm_applies(path, specs[path], calibration)]
    if sharded:
        raise PlanError(
            f"Weight {sharded[0]!r} is sharded over devices, and its algorithm "
            f"({specs[sharded[0]].algorithm!r}) rounds a whole layer at once on one device; "
            "round sharded weights to nearest (weight_algorithm=odmlq.Nearest() in their rules), or "
            "quantize them before sharding.")
    if prefix is not None:
        raise PlanError(
            "quantize_params with a prefix quantizes part of the params, but this plan rounds "
            "weights with an algorithm that reads the whole model's scales; pass all params "
            "(no prefix), or round to nearest (weight_algorithm=odmlq.Nearest()).")
    scales = compute_scales(plan, calibration, params)
    return {p: (scales.weights[p], values) for p, values in scales.weight_values.items()}


def _folded(params: Any, plan, prefix: str | None) -> Any:
    """The params with each folded BatchNorm in its kernel (`odmlq.graph.fold_params`).

    Folding reads the BatchNorm's parameters, so it needs concrete leaves of
    the whole model; abstract shapes fold to the same shapes, and QArrays are
    already folded (quantize_params made them)."""
    ops = folded_ops(plan.graph)
    if not ops:
        return params
    leaves = [leaf for _, leaf in flat_leaves(params)[0]]
    if any(isinstance(x, (jax.ShapeDtypeStruct, QArray)) for x in leaves):
        return params
    if prefix is not None:
        kernels = [o.param for op in ops for o in op.weights if o.role == "weight"]
        inside = [k for k in kernels if prefix.strip("/") == "" or k.startswith(prefix.strip("/") + "/")]
        if inside:
            raise PlanError(
                f"{inside[0]!r} has a BatchNorm folded into it (op {ops[0].id!r}), which quantize_params "
                "folds from the whole model's params; quantize these layers with all params "
                "(no prefix), or keep the BatchNorm's op in float with a skip rule.")
        return params
    return fold_params(plan.graph, params, weight_specs(plan))


def abstract_qarray(shape: tuple[int, ...], spec, sharding=None) -> QArray:
    """The QArray `spec` makes of a tensor of `shape`, with `ShapeDtypeStruct`
    leaves; placed as `quantize_params` places them for a tensor on `sharding`
    (a `NamedSharding` over several devices), else unplaced."""
    qt = spec.qtype
    stored = (packed_size(math.prod(shape), qt),) if qt.values_per_byte > 1 else shape
    s_shape = scale_shape(shape, spec.scale_axes, spec.block_axis, spec.block_size)
    values = scales = None
    if isinstance(sharding, NamedSharding) and len(sharding.device_set) > 1:
        values, scales = quantized_placement(sharding, shape, stored, s_shape)
    zero_point = None if spec.symmetric else jax.ShapeDtypeStruct(s_shape, np.int32, sharding=scales)
    return QArray(qvalue=jax.ShapeDtypeStruct(stored, qt.storage_dtype if qt.values_per_byte == 1 else np.uint8,
                                              sharding=values),
                  scale=jax.ShapeDtypeStruct(s_shape, np.float32, sharding=scales), zero_point=zero_point,
                  qtype=qt.name, shape=tuple(shape), scale_axes=spec.scale_axes,
                  block_axis=spec.block_axis, block_size=spec.block_size,
                  narrow_range=spec.narrow_range)


def weight_scale_of(q: QArray) -> TensorScale:
    """The `TensorScale` a QArray was quantized with (to compute edge and bias scales)."""
    return TensorScale(qtype=q.qtype, scale=np.asarray(q.scale, np.float32),
                       zero_point=None if q.zero_point is None else np.asarray(q.zero_point, np.int32),
                       scale_axes=q.scale_axes, block_axis=q.block_axis, block_size=q.block_size,
                       narrow_range=q.narrow_range)


def check_qarray(path: str, q: QArray, spec) -> None:
    """Refuses a QArray quantized otherwise than the plan says (a stale file, another plan)."""
    layout = (q.qtype, q.scale_axes, q.block_axis, q.block_size, q.narrow_range, q.symmetric)
    wanted = (spec.qtype.name, spec.scale_axes, spec.block_axis, spec.block_size,
              spec.narrow_range, spec.symmetric)
    if layout != wanted:
        raise PlanError(
            f"Parameter {path!r} is a QArray quantized as {q!r}, but the plan asks for "
            f"{spec.describe()}; quantize the float weights with this plan "
            "(odmlq.quantize_params) or use the plan the QArray was made with.")
