"""Reading stored calibrations back: the file layout's fields, and checks
of every entry before it becomes statistics (internal; see `Calibration.load`
and `Calibration.from_json`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from odmlq.calibration._gram import Gram
from odmlq.calibration._histogram import HISTOGRAM_BINS
from odmlq.calibration._headroom import EXTREMES
from odmlq.calibration._statistics import Statistics
from odmlq.calibration._wrapped import CalibrationMethod, parse_calibration_method
from odmlq.errors import CalibrationError

__all__ = ["FIELDS", "FORMAT", "VERSION", "edge_entries", "gram_entries", "grams_of", "statistics_of"]

FORMAT = "odmlq.calibration"
VERSION = 1
# How each Statistics field is stored, and whether it may be absent.
FIELDS: dict[str, tuple[type, bool]] = {
    "count": (np.int64, True),
    "min": (np.float64, True),
    "max": (np.float64, True),
    "sum": (np.float64, True),
    "sum_of_squares": (np.float64, True),
    "batches": (np.int64, True),
    "moving_min": (np.float64, False),
    "moving_max": (np.float64, False),
    "histogram": (np.int64, False),
    "histogram_limit": (np.float64, False),
    "top": (np.float64, False),
    "bottom": (np.float64, False),
}


def gram_entries(metadata: Any, where: str) -> list:
    """The metadata's list of weight input statistics (absent in files without any)."""
    entries = metadata.get("grams", []) if isinstance(metadata, dict) else []
    if not isinstance(entries, list):
        raise CalibrationError(f"{where} has a malformed list of weight input statistics.")
    return entries


def grams_of(metadata: Any, matrices: list[Any], where: str) -> dict[str, Gram]:
    """Parameter path -> Gram, from validated metadata and the stored matrices."""
    entries = gram_entries(metadata, where)
    out = {}
    for entry, matrix in zip(entries, matrices):
        if not isinstance(entry, dict) or not isinstance(entry.get("param"), str) or matrix is None:
            raise CalibrationError(f"{where} has a weight input statistics entry without a "
                                   f"parameter or matrix: {str(entry)[:80]}.")
        if entry["param"] in out:
            raise CalibrationError(f"{where} lists weight {entry['param']!r} twice.")
        out[entry["param"]] = Gram.from_parts(entry, matrix, f"{where}, weight {entry['param']!r}")
    return out


def edge_entries(metadata: Any, where: str) -> list[tuple[str, CalibrationMethod, tuple[int, ...]]]:
    """(edge id, method, keep_axes) per edge, from validated metadata."""
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise CalibrationError(f"{where} is not an odmlq calibration (no format {FORMAT!r}).")
    if metadata.get("version") != VERSION:
        raise CalibrationError(
            f"{where} has calibration format version {metadata.get('version')!r}; this "
            f"odmlq reads version {VERSION}."
        )
    edges = metadata.get("edges")
    if not isinstance(edges, list):
        raise CalibrationError(f"{where} has no list of edges.")
    result = []
    for entry in edges:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            raise CalibrationError(f"{where} has an edge entry without an id: {entry!r}.")
        keep_axes = entry.get("keep_axes")
        if not isinstance(keep_axes, list) or not all(type(a) is int for a in keep_axes):
            raise CalibrationError(f"{where}, edge {entry['id']!r}: bad keep_axes {keep_axes!r}.")
        method = parse_calibration_method(entry.get("method"))
        result.append((entry["id"], method, tuple(keep_axes)))
    if len({e[0] for e in result}) != len(result):
        raise CalibrationError(f"{where} lists an edge id twice.")
    return result


def statistics_of(fields: Mapping[str, Any], keep_axes: tuple[int, ...], where: str) -> Statistics:
    """Statistics from stored arrays, checked for dtype, shape and finiteness."""
    values = {}
    for field, (dtype, required) in FIELDS.items():
        if field not in fields or fields[field] is None:
            if required:
                raise CalibrationError(f"{where}: statistics field {field!r} is missing.")
            values[field] = None
            continue
        try:
            value = np.asarray(fields[field])
        except ValueError as e:  # ragged nested lists in JSON
            raise CalibrationError(f"{where}: statistics field {field!r} is not an array ({e}).") from e
        kind = np.dtype(dtype).kind
        # Integers may stand in for floats (JSON writes 2.0 as 2.0, but be lenient).
        if value.dtype.kind not in (kind, "i" if kind == "f" else kind):
            raise CalibrationError(
                f"{where}: statistics field {field!r} has dtype {value.dtype}, expected {np.dtype(dtype)}."
            )
        values[field] = value.astype(dtype)
    shape = values["min"].shape
    per_channel = ("min", "max", "sum", "sum_of_squares", "moving_min", "moving_max")
    scalars = ("count", "batches", "histogram_limit")
    extremes = [values[f] for f in ("top", "bottom") if values[f] is not None]
    if any(values[f] is not None and values[f].shape != shape for f in per_channel) or any(
        values[f] is not None and values[f].shape != () for f in scalars
    ) or len(extremes) == 1 or any(
        v.shape[:-1] != shape or not 1 <= v.shape[-1] <= EXTREMES for v in extremes
    ):
        raise CalibrationError(f"{where}: statistics arrays have inconsistent shapes.")
    if (values["histogram"] is None) != (values["histogram_limit"] is None) or (
        values["moving_min"] is None
    ) != (values["moving_max"] is None):
        raise CalibrationError(f"{where}: a histogram or moving average is half present.")
    if values["histogram"] is not None and values["histogram"].shape != (HISTOGRAM_BINS,):
        raise CalibrationError(
            f"{where}: histogram has shape {values['histogram'].shape}, expected ({HISTOGRAM_BINS},)."
        )
    if not all(np.all(np.isfinite(v)) for v in values.values() if v is not None) or values["count"] < 1:
        raise CalibrationError(f"{where}: statistics hold non-finite values or no elements.")
    histogram, limit = values["histogram"], values["histogram_limit"]
    # Exact merges rely on a power-of-two limit and on counts that add up.
    if histogram is not None and (
        np.frexp(limit)[0] != 0.5 or histogram.min() < 0 or histogram.sum() != values["count"]
    ):
        raise CalibrationError(
            f"{where}: the histogram is inconsistent (its limit is not a power of two, or "
            "its counts do not add up to the element count)."
        )
    return Statistics(**values, keep_axes=keep_axes)
