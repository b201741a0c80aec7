"""Saving and loading quantized params: safetensors, no pickle, tied to their Plan.

A file holds, per parameter path, either its float array (``path``) or its
QArray's leaves (``path:qvalue``, ``path:scale``, ``path:zero_point``), stored
as they are in memory (int8 codes, packed int4 / nf4 bytes, float8 values as
their bytes). Its metadata records each QArray's layout, and the Plan's
*weight fingerprint*: a hash of every parameter's path, shape and dtype and of
every quantized weight's spec. `load_params` refuses a file whose fingerprint
differs from the plan's, and says which parameters differ.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding

from odmlq.files import atomic_output
from odmlq.errors import PlanError
from odmlq.qarray import QArray
from odmlq.sharding import quantized_placement
from odmlq.xla import _params

__all__ = ["save_params", "load_params", "fingerprint"]

FORMAT = "odmlq.xla.params"
VERSION = 1
# dtypes safetensors' numpy API reads back; others are stored as raw bytes.
_NATIVE = {"int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64", "bool"}


def _weights(plan) -> dict[str, dict]:
    specs = _params.weight_specs(plan)
    return {p: {"shape": list(s), "dtype": d, "spec": specs[p].describe() if p in specs else None}
            for p, (s, d) in sorted(plan.graph.params.items())}


def fingerprint(plan) -> str:
    """A hash of what decides the params' layout: every parameter's path, shape
    and dtype, and every quantized weight's spec (the traced batch size is not in it)."""
    return hashlib.sha256(json.dumps(_weights(plan), sort_keys=True).encode()).hexdigest()[:16]


def save_params(path: str | os.PathLike, params: Any, plan) -> str:
    """Writes quantized params (as `quantize_params` or `QuantizedModel.params` hold them).

    Written atomically: an existing file is replaced only by a complete new one.

    Returns:
      The path written.

    Raises:
      PlanError: the params do not match the plan (missing or extra paths).

    Example:
      >>> odmlq.save_params('model.safetensors', qmodel.params, qmodel.plan)
    """
    from safetensors.numpy import save_file

    leaves, _ = _params.flat_leaves(params)
    flat = dict(leaves)
    _params.check_paths(flat, plan, partial=False)
    tensors: dict[str, np.ndarray] = {}
    layout: dict[str, dict] = {}
    for name, leaf in flat.items():
        if isinstance(leaf, QArray):
            layout[name] = {"qtype": leaf.qtype.name, "shape": list(leaf.shape), "scale_axes": list(leaf.scale_axes),
                            "block_axis": leaf.block_axis, "block_size": leaf.block_size,
                            "narrow_range": leaf.narrow_range, "dtypes": {}}
            parts = {"qvalue": leaf.qvalue, "scale": leaf.scale, "zero_point": leaf.zero_point}
            for part, value in parts.items():
                if value is not None:
                    tensors[f"{name}:{part}"], layout[name]["dtypes"][part] = _stored(value)
        else:
            tensors[name], dtype = _stored(leaf)
            layout[name] = {"dtype": dtype}
    metadata = {"format": FORMAT, "version": str(VERSION), "fingerprint": fingerprint(plan),
                "model": plan.graph.model_name, "weights": json.dumps(_weights(plan)),
                "layout": json.dumps(layout)}
    with atomic_output(path) as temporary:
        save_file(tensors, temporary, metadata=metadata)
    return os.fspath(path)


def _stored(value) -> tuple[np.ndarray, str]:
    array = np.ascontiguousarray(np.asarray(value))
    dtype = array.dtype.name
    if dtype not in _NATIVE:  # float8, bfloat16: their bytes
        array = array.view(np.dtype(f"uint{8 * array.dtype.itemsize}"))
    return array, dtype


def _restored(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype in _NATIVE:
        return array
    return array.view(np.dtype(getattr(ml_dtypes, dtype)))


def load_params(path: str | os.PathLike, plan, *, like: Any = None) -> Any:
    """Reads params written by `save_params` for this plan.

    Args:
      path: the .safetensors file.
      plan: the Plan they must have been made for.
      like: a params tree of the model (float, abstract or quantized; an NNX
        module or state) to lay the result out like; None gives a flat dict
        ``{param path: QArray or array}``. A leaf placed on a mesh (a sharded
        array, or a `jax.ShapeDtypeStruct` with a `NamedSharding`) is loaded
        there: each device reads only its slice of the file, the QArray's
        values split like the float weight and its scales as
        `odmlq.sharding` places them.

    Raises:
      PlanError: the file was made for another plan (names what differs) or
        is not an odmlq params file.

    Example:
      >>> qparams = odmlq.load_params('model.safetensors', plan, like=abstract_variables)
      >>> qmodel = odmlq.ptq(model, plan, qparams, calibration)
    """
    from safetensors import safe_open

    path = os.fspath(path)
    try:
        handle = safe_open(path, "np")
    except Exception as e:  # safetensors raises its own error type on a bad header
        raise PlanError(f"Cannot read {path} as a safetensors file: {e}.") from None
    placements = {} if like is None else {p: _placement(leaf) for p, leaf in _params.flat_leaves(like)[0]}
    with handle as f:
        metadata = f.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise PlanError(f"{path} is not an odmlq quantized-params file (no format={FORMAT!r} "
                            "in its metadata); write it with odmlq.save_params.")
        _check_plan(path, metadata, plan)
        flat = {name: _read(f, name, entry, placements.get(name))
                for name, entry in json.loads(metadata["layout"]).items()}
    if like is None:
        return flat
    leaves, tree = _params.flat_leaves(like)
    _params.check_paths({p: flat[p] for p, _ in leaves if p in flat}, plan, partial=True)
    missing = [p for p, _ in leaves if p not in flat]
    if missing:
        raise PlanError(f"{path} has no {missing[:8]}, which `like` holds; pass params laid out like the model's.")
    return jax.tree_util.tree_unflatten(tree, [flat[p] for p, _ in leaves])


def _placement(leaf: Any) -> NamedSharding | None:
    """Where `like`'s leaf says its loaded value goes: its NamedSharding over
    several devices (of an array, an abstract `ShapeDtypeStruct` or a QArray's
    values), else None (one array on the default device)."""
    if isinstance(leaf, QArray):
        leaf = leaf.qvalue if leaf.qvalue.shape == tuple(leaf.shape) else None
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and len(sharding.device_set) > 1:
        return sharding
    return None


def _read(f, name: str, entry: dict, sharding: NamedSharding | None) -> Any:
    """One stored leaf; with a sharding, each device reads its own slice of
    each part (values split like the float weight, scales as
    `odmlq.sharding` places them)."""
    def part(key: str, dtype: str, placed: NamedSharding | None):
        if placed is None:
            return _restored(f.get_tensor(key), dtype)
        shape = tuple(f.get_slice(key).get_shape())
        return jax.make_array_from_callback(
            shape, placed, lambda index: _restored(np.array(f.get_slice(key)[index]), dtype))

    if "qtype" not in entry:
        return part(name, entry["dtype"], sharding)
    shape = tuple(entry["shape"])
    scales = values = None
    if sharding is not None:
        values, scales = quantized_placement(sharding, shape, f.get_slice(f"{name}:qvalue").get_shape(),
                                             f.get_slice(f"{name}:scale").get_shape())
    parts = {key: part(f"{name}:{key}", dtype, values if key == "qvalue" else scales)
             for key, dtype in entry["dtypes"].items()}
    return QArray(qvalue=jax.numpy.asarray(parts["qvalue"]), scale=jax.numpy.asarray(parts["scale"]),
                  zero_point=None if "zero_point" not in parts else jax.numpy.asarray(parts["zero_point"]),
                  qtype=entry["qtype"], shape=shape, scale_axes=tuple(entry["scale_axes"]),
                  block_axis=entry["block_axis"], block_size=entry["block_size"],
                  narrow_range=entry["narrow_range"])


def _check_plan(path: str, metadata: dict, plan) -> None:
    if metadata.get("fingerprint") == fingerprint(plan):
        return
    saved = json.loads(metadata.get("weights", "{}"))
    ours = _weights(plan)
    differ = [f"{name}: file {_describe(saved.get(name))}, plan {_describe(ours.get(name))}"
              for name in sorted(set(saved) | set(ours)) if saved.get(name) != ours.get(name)]
    raise PlanError(
        f"{path} holds params quantized for another plan (model {metadata.get('model')!r}); "
        f"{len(differ)} parameter(s) differ: " + "; ".join(differ[:6]) + (" ..." if len(differ) > 6 else "")
        + ". Load it with the plan it was saved with, or quantize the float weights for this plan "
        "(odmlq.quantize_params).")


def _describe(entry: dict | None) -> str:
    if entry is None:
        return "absent"
    return f"{tuple(entry['shape'])} {entry['dtype']} {entry['spec'] or 'float'}"
