"""Reads a PyTorch checkpoint's tensors as numpy arrays, without torch and without running its code.

This is the one reader of a pickle-based file in the project. A PyTorch
``.pth`` file is a pickle stream, and unpickling can call any importable
function the file names — running a checkpoint from the internet with
``pickle.load`` (or ``torch.load`` without ``weights_only``) runs whatever it
asks for. This reader does not use Python's pickle module: it runs the
stream's opcodes itself (`_PickleReader`), knows only those a tensor
checkpoint is written with, and resolves only an allow-list of names
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


class UnsafeCheckpointError(OdmlqError, ValueError):
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
"""(module, name) -> what the reader gives for it; every other global is refused."""


class _PickleReader:
    """Runs one pickle's opcodes on a stack, without Python's pickle module.

    Only the opcodes a tensor checkpoint is written with are known (values,
    containers, memo, GLOBAL / STACK_GLOBAL resolved through `ALLOWED`,
    REDUCE of an allowed function, BUILD of a dict, persistent storage ids);
    any other opcode (object construction: NEWOBJ, INST, OBJ, extensions) is
    refused. Nothing the stream names is imported or called unless
    `ALLOWED` maps it to one of this module's functions.
    """

    def __init__(self, file, source: str):
        self.file, self.source = file, source
        self.storages: dict[str, _Storage] = {}

    def _take(self, n: int) -> bytes:
        data = self.file.read(n)
        if len(data) < n:
            raise EOFError("the stream ends inside a pickle")
        return data

    def _line(self) -> bytes:
        data = self.file.readline()
        if not data.endswith(b"\n"):
            raise EOFError("the stream ends inside a pickle")
        return data[:-1]

    def load(self):
        stack: list = []
        marks: list[int] = []
        memo: dict[int, object] = {}

        def since_mark() -> list:
            start = marks.pop()
            items = stack[start:]
            del stack[start:]
            return items

        take, line, unpack = self._take, self._line, struct.unpack
        constants = {b"N": None, b"\x88": True, b"\x89": False}
        lengths = {b"X": "<I", b"\x8c": "<B", b"\x8d": "<Q", b"U": "<B", b"T": "<i", b"C": "<B", b"B": "<I"}
        while True:
            op = take(1)
            if op == b".":  # STOP
                return stack.pop()
            if op in constants:
                stack.append(constants[op])
            elif op == b"\x80":  # PROTO
                take(1)
            elif op == b"\x95":  # FRAME: a length prefix only
                take(8)
            elif op == b"(":
                marks.append(len(stack))
            elif op == b")":
                stack.append(())
            elif op == b"}":
                stack.append({})
            elif op == b"]":
                stack.append([])
            elif op in (b"J", b"K", b"M"):
                fmt = {b"J": "<i", b"K": "<B", b"M": "<H"}[op]
                stack.append(unpack(fmt, take(struct.calcsize(fmt)))[0])
            elif op in (b"\x8a", b"\x8b"):  # LONG1, LONG4
                n = take(1)[0] if op == b"\x8a" else unpack("<i", take(4))[0]
                stack.append(int.from_bytes(take(n), "little", signed=True))
            elif op == b"I":
                text = line()  # protocol 0 writes False and True as I00 and I01
                stack.append(text == b"01" if text in (b"00", b"01") else int(text))
            elif op == b"L":
                stack.append(int(line().rstrip(b"L")))
            elif op == b"G":
                stack.append(unpack(">d", take(8))[0])
            elif op == b"F":
                stack.append(float(line()))
            elif op in lengths:  # strings and bytes with a length prefix
                fmt = lengths[op]
                raw = take(unpack(fmt, take(struct.calcsize(fmt)))[0])
                if op in (b"C", b"B"):  # bytes
                    stack.append(raw)
                else:  # BINUNICODE* are UTF-8; protocol 2's BINSTRINGs are bytes read as latin-1
                    stack.append(raw.decode("utf-8" if op in (b"X", b"\x8c", b"\x8d") else "latin-1"))
            elif op == b"V":
                stack.append(line().decode("raw_unicode_escape"))
            elif op == b"t":
                stack.append(tuple(since_mark()))
            elif op in (b"\x85", b"\x86", b"\x87"):
                n = op[0] - 0x84
                items = tuple(stack[-n:])
                del stack[-n:]
                stack.append(items)
            elif op == b"l":
                stack.append(since_mark())
            elif op == b"d":
                items = since_mark()
                stack.append(dict(zip(items[::2], items[1::2])))
            elif op == b"a":
                value = stack.pop()
                self._container(stack[-1], list).append(value)
            elif op == b"e":
                items = since_mark()
                self._container(stack[-1], list).extend(items)
            elif op == b"s":
                value, key = stack.pop(), stack.pop()
                self._container(stack[-1], dict)[key] = value
            elif op == b"u":
                items = since_mark()
                self._container(stack[-1], dict).update(zip(items[::2], items[1::2]))
            elif op in (b"p", b"q", b"r"):  # PUT, BINPUT, LONG_BINPUT
                memo[self._memo_index(op, b"p", b"q")] = stack[-1]
            elif op == b"\x94":  # MEMOIZE
                memo[len(memo)] = stack[-1]
            elif op in (b"g", b"h", b"j"):  # GET, BINGET, LONG_BINGET
                stack.append(memo[self._memo_index(op, b"g", b"h")])
            elif op == b"c":  # GLOBAL
                module = line().decode("utf-8")
                stack.append(self._global(module, line().decode("utf-8")))
            elif op == b"\x93":  # STACK_GLOBAL
                name, module = stack.pop(), stack.pop()
                stack.append(self._global(str(module), str(name)))
            elif op == b"R":  # REDUCE
                args, function = stack.pop(), stack.pop()
                if not callable(function) or not isinstance(args, tuple):
                    raise TorchCheckpointError(f"{self.source}: the pickle calls {function!r}, which is not a "
                                               "function a tensor checkpoint calls.")
                stack.append(function(*args))
            elif op == b"b":  # BUILD: a state dict's metadata (dropped)
                state = stack.pop()
                self._container(stack[-1], dict)
                if not isinstance(state, dict):
                    raise TorchCheckpointError(f"{self.source}: the pickle sets a {type(state).__name__} state "
                                               "on a dict; the file is not a state dict.")
            elif op in (b"Q", b"P"):  # persistent ids: storages
                stack.append(self._storage(stack.pop() if op == b"Q" else line().decode("ascii")))
            else:
                raise TorchCheckpointError(
                    f"{self.source}: pickle opcode {op!r} at byte {self.file.tell() - 1} is not one a tensor "
                    "checkpoint is written with (it constructs objects or reads extensions); the file is "
                    "not a PyTorch state dict, and nothing in it was run.")

    def _memo_index(self, op: bytes, text: bytes, short: bytes) -> int:
        """The memo index after a PUT/GET opcode: a text line, one byte, or four."""
        if op == text:
            return int(self._line())
        return self._take(1)[0] if op == short else struct.unpack("<I", self._take(4))[0]

    def _container(self, value, kind: type):
        if not isinstance(value, kind):
            raise TorchCheckpointError(f"{self.source}: the pickle adds items to a {type(value).__name__}; "
                                       "the file is not a tensor checkpoint.")
        return value

    def _global(self, module: str, name: str):
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise UnsafeCheckpointError(
                f"{self.source} asks to load the global {module}.{name}, which is not one of the "
                f"names a tensor checkpoint needs ({', '.join(sorted(f'{m}.{n}' for m, n in ALLOWED))}); "
                "it was refused and nothing in the file was run. Only load checkpoints you trust, "
                "and convert them to safetensors where you can.") from None

    def _storage(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"
                and isinstance(pid[1], str) and pid[1] in STORAGE_DTYPES):
            raise TorchCheckpointError(
                f"{self.source}: a persistent id {str(pid)[:80]!r} is not a storage reference "
                "('storage', type, key, location, size); the file is not a tensor checkpoint.")
        _, kind, key, _location, numel = pid[:5]
        return self.storages.setdefault(str(key), _Storage(str(key), STORAGE_DTYPES[kind], int(numel)))


def _load(reader: _PickleReader, what: str):
    """One pickle of the stream, its failures named by the part of the file it is."""
    try:
        return reader.load()
    except (UnsafeCheckpointError, TorchCheckpointError):
        raise
    except Exception as error:  # a truncated or foreign stream: say which part
        raise TorchCheckpointError(f"{reader.source}: cannot read its {what} ({error}); it is not a "
                                   "PyTorch legacy checkpoint, or it is damaged.") from None


def _unpickle_header(file, source: str, what: str):
    return _load(_PickleReader(file, source), what)


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
    reader = _PickleReader(file, source)
    state = _load(reader, "object pickle")
    keys = _unpickle_header(file, source, "storage keys")
    _read_storages(file, reader.storages, keys, source)
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
