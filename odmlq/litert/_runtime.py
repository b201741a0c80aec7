"""Opening a LiteRT interpreter without its start-up chatter.

The runtime's C++ logger writes "INFO: Created TensorFlow Lite XNNPACK
delegate for CPU." to the process's stderr (file descriptor 2, below Python)
every time an interpreter is allocated, and the Python API has no switch for
it. While an interpreter is made and allocated, descriptor 2 is pointed at a
temporary file; what LiteRT wrote there is passed on to `sys.stderr` except
its INFO lines. With ``ODMLQ_VERBOSE=1`` in the environment (``odmlq
--verbose``) nothing is filtered.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator

VERBOSE_ENVIRONMENT = "ODMLQ_VERBOSE"


def verbose() -> bool:
    """Whether the runtime's own log lines are wanted (``ODMLQ_VERBOSE=1``)."""
    return os.environ.get(VERBOSE_ENVIRONMENT, "") not in ("", "0")


@contextlib.contextmanager
def runtime_log_filtered() -> Iterator[None]:
    """Drops LiteRT's INFO lines written to descriptor 2 inside the block;
    every other line is passed on to `sys.stderr` when the block ends."""
    if verbose():
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no descriptor 2 (an embedded interpreter): nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as captured:
        try:
            os.dup2(captured.fileno(), 2)
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode("utf-8", "replace")
            kept = [line for line in text.splitlines(keepends=True) if not line.startswith("INFO: ")]
            if kept:
                sys.stderr.write("".join(kept))


def interpreter(model: bytes | str | os.PathLike, *, num_threads: int | None = None,
                preserve_all_tensors: bool = False, default_delegate: bool = True):
    """A LiteRT interpreter for a .tflite (bytes or path), tensors allocated.

    As ``ai_edge_litert.interpreter.Interpreter`` with the default delegate
    (XNNPACK), without its INFO lines on stderr (``ODMLQ_VERBOSE=1`` keeps
    them).

    Args:
      model: the flatbuffer's bytes, or the path of a .tflite file.
      num_threads: threads the kernels may use (LiteRT's default: None).
      preserve_all_tensors: keep every intermediate tensor readable after
        `invoke` (for dumps and diffs; slower).
      default_delegate: False runs LiteRT's built-in kernels alone.

    Example:
      >>> runner = odmlq.litert.interpreter('model.tflite', num_threads=1)
      >>> runner.get_signature_runner()(input_0=x)
    """
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    source = {"model_content": bytes(model)} if isinstance(model, (bytes, bytearray)) else {
        "model_path": os.fspath(model)}
    with warnings.catch_warnings():
        # It warns that keeping every tensor is for debugging: that is what it was asked for.
        warnings.simplefilter("ignore", UserWarning)
        with runtime_log_filtered():
            resolver = {} if default_delegate else {
                "experimental_op_resolver_type": OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES}
            made = Interpreter(**source, num_threads=num_threads,
                               experimental_preserve_all_tensors=preserve_all_tensors, **resolver)
            made.allocate_tensors()
    return made
