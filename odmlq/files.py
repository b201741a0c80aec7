"""Writing files so that a reader never sees half of one (internal)."""

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
