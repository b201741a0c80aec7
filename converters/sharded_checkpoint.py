"""Checkpoints split over several safetensors files, read one tensor (or one slice of it) at a time.

The layout is the one Hugging Face writes for large models: files
``model-00001-of-0000N.safetensors`` ... and ``model.safetensors.index.json``
mapping every tensor name to its file (``{"metadata": {...}, "weight_map":
{name: file}}``).

`write_sharded` writes such a checkpoint from tensors given one at a time, so
the whole model is never in memory; each file is written to a temporary name
and renamed, and the index is written last, so a checkpoint with an index is
whole. `ShardedCheckpoint` reads it back by name: the shape and dtype from the
files' headers, a tensor or any slice of it (`read`), or a `jax.Array` placed
on a mesh whose devices each read only their own slice (`array`), which is how
a model larger than one device is loaded where it is served.

Example:
  >>> write_sharded('ckpt', ((name, weight) for name, weight in layers()), max_file_bytes=2**30)
  >>> checkpoint = ShardedCheckpoint('ckpt')
  >>> kernel = checkpoint.array('layer_0.up.kernel', NamedSharding(mesh, P(None, 'model')))
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from converters._checkpoint import CheckpointError, ModelFilesError

__all__ = ["INDEX", "ShardedCheckpoint", "write_sharded"]

INDEX = "model.safetensors.index.json"


def write_sharded(directory: str | os.PathLike, tensors: Iterable[tuple[str, np.ndarray]], *,
                  max_file_bytes: int = 2 ** 30, metadata: dict[str, str] | None = None) -> list[str]:
    """Writes `tensors` (name, array), in order, into files of at most
    `max_file_bytes` each (a larger tensor gets a file of its own).

    Only the tensors of one file are held at once. The names of the files are
    fixed once all are written (``-of-0000N``); until the index is written the
    directory holds no checkpoint.

    Returns:
      The file names, in order.

    Raises:
      CheckpointError: a name given twice.
    """
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written: list[tuple[str, list[str]]] = []  # (temporary file, names)
    group: dict[str, np.ndarray] = {}
    size = 0
    seen: set[str] = set()

    def flush():
        nonlocal group, size
        if group:
            handle, temporary = tempfile.mkstemp(prefix=".model-", suffix=".tmp", dir=directory)
            os.close(handle)
            save_file(group, temporary, metadata=metadata)
            written.append((temporary, list(group)))
        group, size = {}, 0

    try:
        for name, value in tensors:
            if name in seen:
                raise CheckpointError(f"write_sharded was given {name!r} twice; give each tensor once.")
            seen.add(name)
            value = np.ascontiguousarray(value)
            if group and size + value.nbytes > max_file_bytes:
                flush()
            group[name] = value
            size += value.nbytes
        flush()
        files = [f"model-{i + 1:05d}-of-{len(written):05d}.safetensors" for i in range(len(written))]
        with contextlib.suppress(FileNotFoundError):  # an older checkpoint here is being replaced
            os.unlink(directory / INDEX)
        for (temporary, _), name in zip(written, files):
            os.chmod(temporary, 0o644)
            os.replace(temporary, directory / name)
        index = {"metadata": dict(metadata or {}),
                 "weight_map": {tensor: file for (_, names), file in zip(written, files) for tensor in names}}
        handle, temporary = tempfile.mkstemp(prefix=".index-", suffix=".tmp", dir=directory)
        with os.fdopen(handle, "w") as out:
            json.dump(index, out, indent=1)
        os.chmod(temporary, 0o644)
        os.replace(temporary, directory / INDEX)
    except BaseException:
        for temporary, _ in written:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        raise
    return files


_CHUNK_BYTES = 8 << 20


def _numpy_dtype(name: str):
    """The numpy dtype of a safetensors dtype name, or None for one read through safetensors."""
    import ml_dtypes

    return {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
            "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
            "BOOL": np.bool_}.get(name)


def _slices(index: Any, ndim: int) -> tuple[slice, ...] | None:
    """`index` as one step-1 slice per axis, or None for other indexing."""
    index = index if isinstance(index, tuple) else (index,)
    if len(index) > ndim or ndim == 0 or not all(isinstance(i, slice) and i.step in (None, 1) for i in index):
        return None
    return index + (slice(None),) * (ndim - len(index))


def _read_rows(path: Path, begin: int, shape: tuple[int, ...], dtype, index: tuple[slice, ...]) -> np.ndarray:
    """The slice `index` of the row-major tensor at byte `begin` of `path`, read in chunks of whole rows."""
    dtype = np.dtype(dtype)
    rows = range(*index[0].indices(shape[0]))
    rest = tuple(range(*i.indices(n)) for i, n in zip(index[1:], shape[1:]))
    row_values = int(np.prod(shape[1:], dtype=np.int64))
    out = np.empty((len(rows), *(len(r) for r in rest)), dtype)
    step = max(1, _CHUNK_BYTES // max(1, row_values * dtype.itemsize))
    with open(path, "rb", buffering=0) as f:
        for start in range(rows.start, rows.stop, step):
            n = min(step, rows.stop - start)
            block = np.empty(n * row_values, dtype)
            f.seek(begin + start * row_values * dtype.itemsize)
            if f.readinto(block.view(np.uint8)) != block.nbytes:
                raise ModelFilesError(f"{str(path)!r} is truncated; copy the whole checkpoint again.")
            out[start - rows.start:start - rows.start + n] = block.reshape(n, *shape[1:])[(slice(None),) + index[1:]]
    return out


class ShardedCheckpoint:
    """A checkpoint `write_sharded` (or Hugging Face) wrote, read tensor by tensor.

    Each read opens the tensor's file for that read alone, so no file stays
    mapped into the process between reads.

    Raises:
      ModelFilesError: no index in `directory`, or a file it names is missing.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        index = self.directory / INDEX
        if not index.is_file():
            raise ModelFilesError(f"No {INDEX} in {str(self.directory)!r}: not a sharded checkpoint (or one "
                                  "whose writing did not finish; write it again).")
        with open(index) as f:
            found = json.load(f)
        self.metadata: dict[str, str] = found.get("metadata", {})
        self.weight_map: dict[str, str] = found["weight_map"]
        missing = sorted({f for f in self.weight_map.values() if not (self.directory / f).is_file()})
        if missing:
            raise ModelFilesError(f"{str(self.directory)!r}: its index names files that are not there: "
                                  f"{', '.join(missing)}; copy the whole checkpoint directory.")
        self._headers: dict[str, dict] = {}
        self._data_start: dict[str, int] = {}

    @property
    def names(self) -> list[str]:
        return list(self.weight_map)

    def _header(self, name: str) -> dict:
        if name not in self.weight_map:
            raise CheckpointError(f"{str(self.directory)!r} has no tensor {name!r}.", missing=(name,))
        file = self.weight_map[name]
        if file not in self._headers:
            with open(self.directory / file, "rb") as f:
                length = int.from_bytes(f.read(8), "little")
                self._headers[file] = json.loads(f.read(length))
            self._data_start[file] = 8 + length
        return self._headers[file][name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header(name)["shape"])

    def read(self, name: str, index: Any = ...) -> np.ndarray:
        """The tensor `name`, or the slice `index` of it (only that slice is read).

        A slice (of slices, as a sharding's indices are) is read with plain
        reads, a few megabytes of whole leading-axis rows at a time, not
        through a memory map: mapped file pages count in the process's
        resident memory while the file is open, and a column slice touches
        every page of its tensor."""
        from safetensors import safe_open

        entry = self._header(name)
        path = self.directory / self.weight_map[name]
        dtype = _numpy_dtype(entry["dtype"])
        if index is not ... and dtype is not None and _slices(index, len(entry["shape"])) is not None:
            return _read_rows(path, self._data_start[self.weight_map[name]] + entry["data_offsets"][0],
                              tuple(entry["shape"]), dtype, _slices(index, len(entry["shape"])))
        with safe_open(str(path), framework="numpy") as f:
            if index is ...:
                return f.get_tensor(name)
            return np.asarray(f.get_slice(name)[index])

    def array(self, name: str, sharding: jax.sharding.Sharding, dtype: Any = None) -> jax.Array:
        """`name` as a `jax.Array` placed with `sharding`: each device reads its own slice.

        A slice is placed on its devices before the next is read, so the host
        holds one slice at a time, not the whole tensor besides its placed copy."""
        shape = self.shape(name)
        by_slice: dict[str, list] = {}
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            by_slice.setdefault(repr(index), [index, []])[1].append(device)
        placed = {}
        for index, devices in by_slice.values():
            values = self.read(name, index)
            if dtype is not None:
                values = values.astype(dtype)
            for device in devices:
                placed[device] = jax.device_put(values, device)
            del values
        arrays = [placed[d] for d in sharding.addressable_devices_indices_map(shape)]
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)

    def __iter__(self) -> Iterator[str]:
        return iter(self.weight_map)
