"""Reads a PyTorch checkpoint's tensors as numpy arrays, without torch and without running its code.

This is the one reader of a pickle-based file in the project. A PyTorch
``.pth`` file is a pickle stream, and unpickling can call any importable
function the file names — running a checkpoint from the internet with
``pickle.load`` (or ``torch.load`` without ``weights_only``) runs whatever it
asks for. This reader's unpickler resolves only an allow-list of names
(`ALLOWED`): the ordered dict a state dict is, PyTorch's tensor-rebuild
functions (re-implemented here on numpy; nothing is imported from torch) and
its storage types (mapped to numpy dtypes). A file that names anything else
is refused with `UnsafeCheckpointError` before any of it is used.

Formats:

- PyTorch's *legacy* serialization (``torch.save(..., _use_new_zipfile_serialization=False)``,
  the default before PyTorch 1.6): five pickles — magic number, protocol
  version, system info, the object (its tensors point at storages by key),
  the storage keys — then each storage as an int64 element count and its raw
  little-endian bytes.
- The zip serialization of later releases is refused with a clear message:
  re-save the checkpoint in the legacy format or as safetensors.

Example:
  >>> state = read_state_dict("efficientnet-lite0.pth")
  >>> state["_conv_stem.weight"].shape
  (32, 3, 3, 3)
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from converters._checkpoint import ModelFilesError
from odmlq import OdmlqError

__all__ = ["ALLOWED", "STORAGE_DTYPES", "TorchCheckpointError", "UnsafeCheckpointError",
           "read_state_dict"]

# PyTorch's legacy format starts with this number, pickled.
MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001

STORAGE_DTYPES = {
    "FloatStorage": np.dtype(np.float32), "DoubleStorage": np.dtype(np.float64),
    "HalfStorage": np.dtype(np.float16), "BFloat16Storage": np.dtype(ml_dtypes.bfloat16),
    "LongStorage": np.dtype(np.int64), "IntStorage": np.dtype(np.int32),
    "ShortStorage": np.dtype(np.int16), "CharStorage": np.dtype(np.int8),
    "ByteStorage": np.dtype(np.uint8), "BoolStorage": np.dtype(np.bool_),
}


class TorchCheckpointError(OdmlqError, ValueError):
    """A file that is not a PyTorch legacy checkpoint, or whose storages do not add up."""


class UnsafeCheckpointError(OdmlqError, pickle.UnpicklingError):
    """The checkpoint's pickle names a global outside the allow-list; nothing from it was run."""


@dataclass
class _Storage:
    key: str
    dtype: np.dtype
    numel: int
    data: np.ndarray | None = None


@dataclass
class _TensorRef:
    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def array(self, name: str) -> np.ndarray:
        data = self.storage.data
        extent = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride) if n > 0)
        if any(s < 0 for s in self.stride) or (0 not in self.shape and extent >= data.size):
            raise TorchCheckpointError(
                f"Tensor {name!r}: shape {self.shape}, stride {self.stride} and offset {self.offset} "
                f"reach past its storage of {data.size} elements; the file is damaged.")
        if 0 in self.shape:
            return np.zeros(self.shape, data.dtype)
        item = data.itemsize
        view = np.lib.stride_tricks.as_strided(
            data[self.offset:], self.shape, tuple(s * item for s in self.stride), writeable=False)
        return np.array(view)


def _rebuild_tensor(storage, storage_offset, size, stride, *unused):
    """``torch._utils._rebuild_tensor_v2`` (storage, offset, size, stride, requires_grad, hooks[, metadata])."""
    if not isinstance(storage, _Storage):
        raise TorchCheckpointError("A tensor in the checkpoint is not backed by a storage.")
    return _TensorRef(storage, int(storage_offset), tuple(int(n) for n in size),
                      tuple(int(s) for s in stride))


def _rebuild_parameter(data, requires_grad, backward_hooks, *unused):
    """``torch._utils._rebuild_parameter``: an ``nn.Parameter`` is its tensor here."""
    return data


ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    **{("torch", name): name for name in STORAGE_DTYPES},
}
"""(module, name) -> what the unpickler gives for it; every other global is refused."""


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str):
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise UnsafeCheckpointError(
                f"{self.source} asks to load the global {module}.{name}, which is not one of the "
                f"names a tensor checkpoint needs ({', '.join(sorted(f'{m}.{n}' for m, n in ALLOWED))}); "
                "it was refused and nothing in the file was run. Only load checkpoints you trust, "
                "and convert them to safetensors where you can.") from None

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"
                and isinstance(pid[1], str) and pid[1] in STORAGE_DTYPES):
            raise TorchCheckpointError(
                f"{self.source}: a persistent id {str(pid)[:80]!r} is not a storage reference "
                "('storage', type, key, location, size); the file is not a tensor checkpoint.")
        _, kind, key, _location, numel = pid[:5]
        storage = self.storages.setdefault(str(key), _Storage(str(key), STORAGE_DTYPES[kind], int(numel)))
        return storage


def _load(unpickler: _AllowListUnpickler, what: str):
    """One pickle of the stream, its failures named by the part of the file it is."""
    try:
        return unpickler.load()
    except (UnsafeCheckpointError, TorchCheckpointError):
        raise
    except Exception as error:  # a truncated or foreign stream: say which part
        raise TorchCheckpointError(f"{unpickler.source}: cannot read its {what} ({error}); it is not a "
                                   "PyTorch legacy checkpoint, or it is damaged.") from None


def _unpickle_header(file, source: str, what: str):
    return _load(_AllowListUnpickler(file, source), what)


def read_state_dict(path: str | Path) -> dict[str, np.ndarray]:
    """Name -> numpy array for every tensor of a PyTorch legacy checkpoint (a state dict).

    Raises:
      ModelFilesError: `path` is not a file.
      UnsafeCheckpointError: the pickle names a global outside `ALLOWED`.
      TorchCheckpointError: a zip-format checkpoint, a file that is not a
        PyTorch checkpoint, an object that is not a flat name -> tensor
        mapping, or storages that are short or inconsistent.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelFilesError(f"{path} is not a file; pass the .pth checkpoint's path.")
    data = path.read_bytes()
    source = str(path)
    if data[:4] == b"PK\x03\x04":
        raise TorchCheckpointError(
            f"{source} is a zip-format PyTorch checkpoint (PyTorch >= 1.6); this reader takes the "
            "legacy format. Re-save it with torch.save(state_dict, f, "
            "_use_new_zipfile_serialization=False), or as safetensors.")
    file = io.BytesIO(data)
    if _unpickle_header(file, source, "magic number") != MAGIC_NUMBER:
        raise TorchCheckpointError(f"{source} does not start with PyTorch's magic number; it is not a "
                                   "PyTorch legacy checkpoint.")
    if _unpickle_header(file, source, "protocol version") != PROTOCOL_VERSION:
        raise TorchCheckpointError(f"{source}: unsupported PyTorch serialization protocol.")
    system = _unpickle_header(file, source, "system information")
    if not (isinstance(system, dict) and system.get("little_endian", True)):
        raise TorchCheckpointError(f"{source} was saved on a big-endian machine; re-save it on a "
                                   "little-endian one.")
    unpickler = _AllowListUnpickler(file, source)
    state = _load(unpickler, "object pickle")
    keys = _unpickle_header(file, source, "storage keys")
    _read_storages(file, unpickler.storages, keys, source)
    return _tensors(state, source)


def _read_storages(file, storages: dict[str, _Storage], keys, source: str) -> None:
    if not isinstance(keys, list) or set(map(str, keys)) != set(storages):
        raise TorchCheckpointError(f"{source}: its storage key list does not match the storages its "
                                   "tensors use; the file is damaged.")
    for key in map(str, keys):
        storage = storages[key]
        header = file.read(8)
        if len(header) < 8:
            raise TorchCheckpointError(f"{source} ends before storage {key}; the file is truncated.")
        (numel,) = struct.unpack("<q", header)
        if numel != storage.numel:
            raise TorchCheckpointError(f"{source}: storage {key} holds {numel} elements, its tensors "
                                       f"say {storage.numel}; the file is damaged.")
        raw = file.read(numel * storage.dtype.itemsize)
        if len(raw) < numel * storage.dtype.itemsize:
            raise TorchCheckpointError(f"{source} ends inside storage {key}; the file is truncated.")
        storage.data = np.frombuffer(raw, storage.dtype.newbyteorder("<")).astype(storage.dtype)


def _tensors(state, source: str) -> dict[str, np.ndarray]:
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise TorchCheckpointError(
            f"{source} holds a {type(state).__name__}, not a state dict (name -> tensor). Save "
            "model.state_dict(), not the model or a training-state dict.")
    arrays = {}
    for name, value in state.items():
        if not isinstance(value, _TensorRef):
            raise TorchCheckpointError(f"{source}: entry {name!r} is a {type(value).__name__}, not a "
                                       "tensor; save model.state_dict() alone.")
        arrays[name] = value.array(name)
    return arrays
