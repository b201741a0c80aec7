"""Files (internal): writing so that a reader never sees half of one, and
reading the .npz inputs and .tflite models commands are given."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

from odmlq.errors import OdmlqError


def check_output_path(path: str | os.PathLike) -> str:
    """`path` as a string, if a file can be written there (checked before any work).

    Raises:
      OdmlqError: `path` is a directory, or its directory does not exist or is
        not writable.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise OdmlqError(f"Cannot write {path!r}: it is a directory; give a file path, e.g. "
                         f"{os.path.join(path, 'model.tflite')!r}.")
    if not os.path.isdir(directory):
        raise OdmlqError(f"Cannot write {path!r}: directory {directory!r} does not exist.")
    if not os.access(directory, os.W_OK):
        raise OdmlqError(f"Cannot write {path!r}: directory {directory!r} is not writable; choose another.")
    return path


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[str]:
    """Yields a temporary path beside `path`; on success it replaces `path`.

    The caller writes the whole file to the yielded path. It is then synced,
    made readable (mkstemp makes it private; nothing odmlq writes is secret)
    and renamed over `path`, so an existing file is only ever replaced by a
    complete new one. On any error the temporary file is removed.

    Raises:
      OdmlqError: the directory does not exist or is not writable.
    """
    path = check_output_path(path)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        handle, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                                             dir=directory)
        os.close(handle)
    except OSError as e:
        raise OdmlqError(f"Cannot write {path!r}: {e.strerror}; choose a writable directory.") from None
    try:
        yield temporary
        with open(temporary, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def read_arrays(path: str, what: str) -> dict:
    """The arrays of an .npz, by name, in the file's order."""
    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError) as e:
        raise OdmlqError(f"Cannot read {what} {path!r}: {getattr(e, 'strerror', None) or e}; give an .npz "
                         "with one array per model input (numpy.savez).") from None
    if not arrays:
        raise OdmlqError(f"{what} {path!r} holds no arrays; give one array per model input (numpy.savez).")
    return arrays



def load_batches(path: str, batch_size: int, what: str) -> list[tuple]:
    """Batches of `batch_size` rows of an .npz holding one array per model input."""
    if batch_size < 1:
        raise OdmlqError(f"--batch-size {batch_size} must be at least 1.")
    arrays = list(read_arrays(path, what).values())
    n = len(arrays[0])
    return [tuple(a[i:i + batch_size] for a in arrays) for i in range(0, n, batch_size)]



def read_model_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise OdmlqError(f"Cannot read model {path!r}: {e.strerror}; give a .tflite file.") from None
