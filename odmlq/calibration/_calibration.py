"""Calibration: streamed statistics of tensors, and the float ranges they give.

A calibration *method* is a frozen dataclass (`MinMax()`, `Percentile(99.99)`,
`MSE()`, ...). `observe` folds one batch of a tensor into `Statistics`;
`merge` combines statistics from other batches or processes; `compute_range`
turns them into the float range [lo, hi] to quantize with. `range_of` does
all three at once, for weights. `Calibration` keeps one (method, Statistics)
per edge of a model and saves it without pickle (`.npz` or JSON).

Every range contains zero, because zero must be exactly representable
(padding, ReLU outputs); TFLite and PyTorch observers widen ranges the same
way. A symmetric range has lo == -hi.

Example:
  >>> import numpy as np
  >>> x = np.array([-1.0, 0.5, 3.0], np.float32)
  >>> range_of(MinMax(), x, 'int8', symmetric=False)
  (array(-1., dtype=float32), array(3., dtype=float32))
"""

from __future__ import annotations

import json
import os
import zipfile
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from odmlq.calibration._gram import Gram
from odmlq.calibration._stored import FIELDS, FORMAT, VERSION, edge_entries, gram_entries, grams_of, statistics_of
from odmlq.calibration._wrapped import CalibrationMethod, parse_calibration_method
from odmlq.calibration._statistics import Statistics, compute_range, merge, observe_parts
from odmlq.errors import CalibrationError
from odmlq.files import atomic_output
from odmlq.qtypes import QType

__all__ = ["Calibration", "channel_key"]



def channel_key(edge_id: str) -> str:
    """The entry holding an edge's per-channel minima and maxima, observed
    besides its own statistics where the plan balances a sum's offsets
    (`Plan.balanced_sums`)."""
    return f"{edge_id}#channels"


class Calibration(Mapping[str, tuple[CalibrationMethod, Statistics]]):
    """Statistics per edge of a model: edge id -> (method, Statistics).

    Besides edges, it holds the inputs' second moment (`Gram`) of each weight
    a data-driven weight algorithm rounds (`odmlq.GPTQ`), by parameter path
    (`grams`). Observing mutates the calibration in place; `merge` returns a
    new one.

    Example:
      >>> cal = Calibration()
      >>> for batch in [np.ones(3), -np.ones(3)]:
      ...     cal.observe('dense/out', MinMax(), batch)
      >>> cal.range('dense/out', 'int8', symmetric=False)
      (array(-1., dtype=float32), array(1., dtype=float32))
    """

    def __init__(self, entries: Mapping[str, tuple[CalibrationMethod, Statistics]] | None = None,
                 grams: Mapping[str, Gram] | None = None):
        self._entries: dict[str, tuple[CalibrationMethod, Statistics]] = {}
        for edge_id, (method, stats) in (entries or {}).items():
            self._entries[str(edge_id)] = (parse_calibration_method(method), stats)
        self._grams: dict[str, Gram] = dict(grams or {})

    def __getitem__(self, edge_id: str) -> tuple[CalibrationMethod, Statistics]:
        if edge_id not in self._entries:
            known = list(self._entries)[:5]
            raise KeyError(
                f"No calibration for edge {edge_id!r}; it has {len(self._entries)} "
                f"edges, e.g. {known}. Observe the edge first."
            )
        return self._entries[edge_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, edge_id: object) -> bool:
        return edge_id in self._entries

    def __repr__(self) -> str:
        parts = [f"{e!r}: {m!r}" for e, (m, _) in list(self._entries.items())[:3]]
        more = ", ..." if len(self) > 3 else ""
        return f"Calibration({len(self)} edges: {{{', '.join(parts)}{more}}})"

    @property
    def edges(self) -> tuple[str, ...]:
        """Edge ids, in the order they were first observed."""
        return tuple(self._entries)

    @property
    def grams(self) -> Mapping[str, Gram]:
        """Parameter path -> the second moment of the weight's inputs (read-only)."""
        return dict(self._grams)

    def observe_gram(self, param: str, gram: Gram) -> None:
        """Adds one batch's `Gram` of the inputs of weight `param`.

        Raises:
          CalibrationError: the weight was observed before with another layout.
        """
        previous = self._grams.get(param)
        self._grams[param] = gram if previous is None else previous.merged(gram, f"Weight {param!r}")

    def observe(
        self,
        edge_id: str,
        method: CalibrationMethod | dict[str, Any] | str,
        x: Any,
        *,
        keep_axes: Sequence[int] = (),
        batch_index: int | None = None,
    ) -> None:
        """Folds one batch of edge `edge_id` into its statistics.

        Args:
          edge_id: the edge's stable id in the plan.
          method: its calibration method; the same for every batch.
          x: the batch (numpy or jax array).
          keep_axes: axes kept per channel; the same for every batch.
          batch_index: named in error messages when given.

        Raises:
          CalibrationError: as `observe`, naming the edge (and batch); or the
            edge was observed before with another method.
        """
        self.observe_parts(edge_id, method, [x], keep_axes=keep_axes, batch_index=batch_index)

    def observe_parts(
        self,
        edge_id: str,
        method: CalibrationMethod | dict[str, Any] | str,
        parts: Sequence[Any],
        *,
        keep_axes: Sequence[int] = (),
        batch_index: int | None = None,
    ) -> None:
        """Folds one batch of edge `edge_id`, given as disjoint parts (what
        each device computed of it), into its statistics: as `observe` of
        the whole batch (see `odmlq.calibration.observe_parts`).

        Raises:
          CalibrationError: as `observe`.
        """
        method = parse_calibration_method(method)
        where = f"edge {edge_id!r}" + ("" if batch_index is None else f", batch {batch_index}")
        previous = self._entries.get(edge_id)
        if previous is not None and previous[0] != method:
            raise CalibrationError(
                f"Calibration of {where}: observed with {previous[0]!r} before, now "
                f"{method!r}; use one method per edge."
            )
        try:
            stats = observe_parts(method, None if previous is None else previous[1], parts, keep_axes=keep_axes)
        except CalibrationError as e:
            raise CalibrationError(f"Calibration of {where}: {e}") from e
        self._entries[edge_id] = (method, stats)

    def merge(self, other: Calibration) -> Calibration:
        """Combines two calibrations of the same edges (e.g. from two processes).

        Raises:
          CalibrationError: the edges or their methods differ.
        """
        if set(self._entries) != set(other._entries):
            only = sorted(set(self._entries) ^ set(other._entries))
            raise CalibrationError(
                f"Cannot merge calibrations of different edges: edge {only[0]!r} is in "
                f"only one of them ({len(only)} such edges); calibrate the same plan."
            )
        merged = {}
        for edge_id, (method, stats) in self._entries.items():
            other_method, other_stats = other._entries[edge_id]
            if other_method != method:
                raise CalibrationError(
                    f"Cannot merge edge {edge_id!r}: calibrated with {method!r} and "
                    f"{other_method!r}; calibrate both with the same rules."
                )
            try:
                merged[edge_id] = (method, merge(method, stats, other_stats))
            except CalibrationError as e:
                raise CalibrationError(f"Cannot merge edge {edge_id!r}: {e}") from e
        if set(self._grams) != set(other._grams):
            only = sorted(set(self._grams) ^ set(other._grams))
            raise CalibrationError(
                f"Cannot merge calibrations: the inputs of weight {only[0]!r} were observed in "
                "only one of them; calibrate the same plan.")
        grams = {p: g.merged(other._grams[p], f"Cannot merge weight {p!r}") for p, g in self._grams.items()}
        return Calibration(merged, grams)

    def range(self, edge_id: str, qtype: QType | str, *, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
        """The (lo, hi) float32 range of an edge; see `compute_range`."""
        if edge_id not in self._entries:
            raise CalibrationError(
                f"No calibration for edge {edge_id!r} ({len(self)} edges, e.g. "
                f"{list(self._entries)[:5]}); run calibration over data that reaches it."
            )
        method, stats = self._entries[edge_id]
        try:
            return compute_range(method, stats, qtype, symmetric=symmetric)
        except CalibrationError as e:
            raise CalibrationError(f"Range of edge {edge_id!r}: {e}") from e

    def save(self, path: str | os.PathLike) -> None:
        """Writes one `.npz` atomically (temp file, then rename), without pickle.

        The file holds the arrays of every edge's statistics and a JSON string
        (as uint8) of edge ids, methods and keep_axes. It is written to `path`
        exactly, with no `.npz` appended.
        """
        path = os.fspath(path)
        metadata, arrays = self._metadata(), {}
        for i, (_, stats) in enumerate(self._entries.values()):
            for field in FIELDS:
                if getattr(stats, field) is not None:
                    arrays[f"edge{i}.{field}"] = np.asarray(getattr(stats, field))
        for i, gram in enumerate(self._grams.values()):
            arrays[f"gram{i}"] = gram.matrix
        arrays["metadata"] = np.frombuffer(json.dumps(metadata).encode(), np.uint8)
        with atomic_output(path) as temporary:
            with open(temporary, "wb") as f:
                np.savez_compressed(f, **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Calibration:
        """Reads a file written by `save` (never unpickling anything).

        Raises:
          CalibrationError: the file is not an odmlq calibration, or is corrupt.
          FileNotFoundError: there is no such file.
        """
        path = os.fspath(path)
        try:
            loaded = np.load(path, allow_pickle=False)
            if not isinstance(loaded, np.lib.npyio.NpzFile):
                raise CalibrationError(f"{path!r} is a single .npy array, not a calibration.")
            with loaded as data:
                if "metadata" not in data.files:
                    raise CalibrationError(f"{path!r} has no calibration metadata.")
                metadata = json.loads(data["metadata"].tobytes().decode())
                edges = edge_entries(metadata, path)
                arrays = [
                    {f: data[f"edge{i}.{f}"] for f in FIELDS if f"edge{i}.{f}" in data.files}
                    for i in range(len(edges))
                ]
                grams = grams_of(metadata, [data[f"gram{i}"] if f"gram{i}" in data.files else None
                                          for i in range(len(gram_entries(metadata, path)))], path)
        except CalibrationError as e:
            if path in str(e):
                raise
            raise CalibrationError(f"{path!r}: {e}") from e
        except FileNotFoundError:
            raise
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as e:
            raise CalibrationError(
                f"{path!r} is not a readable odmlq calibration file ({type(e).__name__}: {e}); "
                "write it with Calibration.save."
            ) from e
        return cls._build(edges, arrays, path, grams)

    def to_json(self) -> str:
        """A JSON string of everything (arrays as lists); for small calibrations."""
        metadata = self._metadata()
        for entry, (_, stats) in zip(metadata["edges"], self._entries.values()):
            entry["statistics"] = {
                f: np.asarray(getattr(stats, f)).tolist()
                for f in FIELDS
                if getattr(stats, f) is not None
            }
        for entry, gram in zip(metadata["grams"], self._grams.values()):
            entry["matrix"] = gram.matrix.tolist()
        return json.dumps(metadata)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        """Inverse of `to_json`.

        Raises:
          CalibrationError: the text is not a calibration written by `to_json`.
        """
        where = "calibration JSON"
        try:
            metadata = json.loads(text)
        except (TypeError, ValueError) as e:
            raise CalibrationError(f"The {where} does not parse: {e}.") from e
        edges = edge_entries(metadata, where)
        arrays = []
        for entry in metadata["edges"]:
            stats = entry.get("statistics")
            if not isinstance(stats, dict):
                raise CalibrationError(f"The {where} has no statistics for edge {entry['id']!r}.")
            arrays.append(stats)
        grams = grams_of(metadata, [entry.get("matrix") if isinstance(entry, dict) else None
                                  for entry in gram_entries(metadata, where)], where)
        return cls._build(edges, arrays, where, grams)

    def _metadata(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "edges": [
                {"id": e, "method": m.to_dict(), "keep_axes": list(s.keep_axes)}
                for e, (m, s) in self._entries.items()
            ],
            "grams": [{"param": p, **g.metadata()} for p, g in self._grams.items()],
        }

    @classmethod
    def _build(
        cls, edges: list[tuple[str, CalibrationMethod, tuple[int, ...]]],
        arrays: list[Mapping[str, Any]], where: str, grams: Mapping[str, Gram],
    ) -> Calibration:
        entries = {}
        for (edge_id, method, keep_axes), fields in zip(edges, arrays):
            entries[edge_id] = (method, statistics_of(fields, keep_axes, f"{where}, edge {edge_id!r}"))
        return cls(entries, grams)
