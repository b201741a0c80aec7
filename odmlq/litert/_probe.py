"""A .tflite is loaded and invoked in a child process before odmlq's own
process touches it with an interpreter.

LiteRT aborts the whole process on some models instead of raising (seen: a
SOFTMAX input scale of 1.3e36, calibrated from an attention mask's
``finfo(float32).min``, aborts inside ``allocate_tensors``; any interpreter
that loads the file dies the same way). A probe that dies becomes a
`LiteRTCrashError` that names the model; the caller's process goes on and
nothing is written.
"""

from __future__ import annotations

import collections
import hashlib
import os
import signal
import subprocess
import sys
import tempfile

from odmlq.errors import OdmlqError
from odmlq.litert._convert import ConversionError

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_probe_child.py")
# Digests of models already probed without finding anything, most recent last
# (verification and reports open the same model several times).
_PROBED: collections.OrderedDict[str, None] = collections.OrderedDict()
_REMEMBERED = 256


class LiteRTCrashError(OdmlqError, RuntimeError):
    """The LiteRT interpreter crashed (a signal, not an exception) on a model."""


def probe(tflite: bytes, what: str = "the model") -> None:
    """Loads, allocates and invokes `tflite` once in a child process.

    Raises:
      LiteRTCrashError: the interpreter killed the child (naming the signal
        and what it printed last); `what` names the model in the message.
    """
    digest = hashlib.sha256(tflite).hexdigest()
    if digest in _PROBED:
        _PROBED.move_to_end(digest)
        return
    _run_child(tflite, what)
    _PROBED[digest] = None
    while len(_PROBED) > _REMEMBERED:
        _PROBED.popitem(last=False)


def _run_child(tflite: bytes, what: str) -> None:
    with tempfile.TemporaryDirectory(prefix="odmlq-probe-") as tmp:
        path = os.path.join(tmp, "model.tflite")
        with open(path, "wb") as f:
            f.write(tflite)
        # -P: the script's directory (odmlq/litert, with its inspect.py) must
        # not shadow the standard library.
        done = subprocess.run([sys.executable, "-P", _CHILD, path], capture_output=True, text=True)
    if done.returncode == 0:
        return
    lines = "\n".join(done.stderr.strip().splitlines()[-8:])
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        raise LiteRTCrashError(
            f"The LiteRT interpreter crashed ({name}) loading or running {what}; any program that "
            "loads it would die the same way. Usually a tensor's scale is out of its kernel's range "
            "(look at the scales of the edges it names), or LiteRT mis-handles an op: keep that op "
            f"in float with a skip rule.\n{lines}")
    if done.returncode == 3:
        raise ConversionError(f"LiteRT cannot load {what}: {lines.strip()}. The converted model is not "
                              "valid for the interpreter; keep the op it names in float with a skip rule.")
    raise LiteRTCrashError(f"The LiteRT interpreter failed on {what} (exit {done.returncode}).\n{lines}")
