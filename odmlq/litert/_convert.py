"""Conversion: a JAX function to .tflite bytes with litert-converter.

No TensorFlow: the function is lowered to StableHLO, parsed in the
converter's MLIR context, converted with strict QDQ semantics and exported as
a flatbuffer with a ``serving_default`` signature.

The converter runs in a child process (`_convert_child.py`, 0.3 s of
start-up): litert-converter 0.5.0 crashes the process outright on
some inputs (a segmentation fault), and a crash must become an error that
says what was being converted, not the end of the user's program.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from odmlq.errors import OdmlqError


_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_convert_child.py")


class ConversionError(OdmlqError, RuntimeError):
    """litert-converter failed; the message keeps its diagnostics.

    `locations` holds the scope paths (``op id/primitive``) the diagnostics name.
    """

    locations: tuple[str, ...] = ()


def convert(fn: Callable, example_inputs: Sequence[Any], *, input_names: Sequence[str],
            output_names: Sequence[str], dynamic_range: bool = False) -> bytes:
    """Lowers `fn` on `example_inputs` and converts it to a flatbuffer.

    Raises:
      ConversionError: with the converter's diagnostics and the op ids named in them.
    """
    return convert_stablehlo(lowered(fn, example_inputs), input_names=input_names, output_names=output_names,
                             dynamic_range=dynamic_range)


def lowered(fn: Callable, example_inputs: Sequence[Any]) -> str:
    """`fn` lowered on `example_inputs` to StableHLO text."""
    import jax

    # debug_info keeps named-scope locations: tensor names then carry op ids.
    return jax.jit(fn, keep_unused=True).lower(*example_inputs).as_text(debug_info=True)


def convert_stablehlo(text: str, *, input_names: Sequence[str], output_names: Sequence[str],
                      dynamic_range: bool = False) -> bytes:
    """Converts StableHLO text in a child process (one ``serving_default`` signature)."""
    return convert_signatures([("serving_default", text, input_names, output_names)], dynamic_range=dynamic_range)


def convert_signatures(signatures: Sequence[tuple[str, str, Sequence[str], Sequence[str]]], *,
                       dynamic_range: bool = False) -> bytes:
    """Converts one StableHLO text per signature ``(name, text, input names, output
    names)`` into one flatbuffer, one subgraph and signature each, in a child
    process. Constants equal in several texts (a weight two signatures read)
    are stored once."""
    with tempfile.TemporaryDirectory(prefix="odmlq-convert-") as tmp:
        target, report = (os.path.join(tmp, n) for n in ("out.tflite", "report.json"))
        sources = []
        for i, (name, text, input_names, output_names) in enumerate(signatures):
            source = os.path.join(tmp, f"in{i}.mlir")
            with open(source, "w", encoding="utf-8") as f:
                f.write(text)
            sources.append({"path": source, "name": name, "inputs": list(input_names),
                            "outputs": list(output_names)})
        args = {"sources": sources, "target": target, "report": report, "dynamic_range": dynamic_range}
        # Run as a script, not `-m`: importing the odmlq package (jax, flax)
        # would triple the child's start-up.
        # -P: the script's own directory (odmlq/litert, with its inspect.py) must
        # not shadow the standard library.
        done = subprocess.run([sys.executable, "-P", _CHILD, json.dumps(args)], capture_output=True,
                              text=True)
        if done.returncode == 0 and os.path.exists(target):
            with open(target, "rb") as f:
                return f.read()
        details = {}
        if os.path.exists(report):
            with open(report, encoding="utf-8") as f:
                details = json.load(f)
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        lines = "\n".join(done.stderr.strip().splitlines()[-15:])
        error = ConversionError(
            f"litert-converter crashed ({name}) while converting the model. This is a converter "
            "bug; keep the op it crashed on in float (a skip rule) or quantize it differently.\n"
            f"{lines}")
        error.locations = tuple(re.findall(r"jit\([^)]*\)/([^\"]+)\"", done.stderr))
        raise error
    detail = "\n".join(details.get("diagnostics", [])) or done.stderr.strip()[-3000:]
    message = _readable(f"{details.get('error', '')}\n{detail}")
    error = ConversionError(f"litert-converter failed: {message}")
    # The first location is the op the converter failed on; the rest of the
    # diagnostic lists where its operands came from.
    error.locations = tuple(re.findall(r"jit\([^)]*\)/([^\"]+)\"", details.get("error", "") + detail)[:1])
    raise error


# A diagnostic's source position ("/path/odmlq/graph/_program.py:204:11: ")
# is where odmlq evaluated the primitive, not where the user's model wrote it:
# the op and module it belongs to are named instead (see export).
_POSITION = re.compile(r"(?:/[^\s:\"]+)+\.py:\d+:\d+: ")


def _readable(text: str) -> str:
    """The converter's errors without Python call stacks and MLIR location dumps."""
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        unconverted = re.match(r'loc\(.*?"jit\([^)]*\)/([^"]+)".*: (\S+ was not converted to a LiteRT op)',
                               stripped)
        if unconverted:
            lines.append(f"{unconverted.group(1)}: {unconverted.group(2)}")
            continue
        if not stripped or stripped.startswith(("loc(", "^")) or "note: called from" in line:
            continue
        if lines and not _POSITION.search(line) and not stripped.startswith(("error", "ValueError")):
            continue  # a source line echoed under a position
        lines.append(_POSITION.sub("", stripped))
    return "\n".join(dict.fromkeys(lines))[:2000]
