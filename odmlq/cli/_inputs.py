"""What a command reads and writes, checked before any model is traced:
models by name, .npz inputs, rules, calibration, output paths."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import warnings
from collections.abc import Iterator

from odmlq.errors import OdmlqError

DEFAULT_RULES = "int8 weights (per-channel) and int8 activations everywhere"

# The repository's samples are loaded by name, as any user's module:function
# is: odmlq itself never depends on them (an installed odmlq may lack them).
SAMPLES_MODULE = "samples.models"


def samples() -> dict:
    try:
        return importlib.import_module(SAMPLES_MODULE).SAMPLES
    except ImportError:  # an installed odmlq without the repository's samples/
        return {}


def load_model(target: str):
    """(model, example_inputs, variables) from a sample name or module:function."""
    found = samples()
    if target in found:
        return found[target]()
    if ":" not in target:
        raise OdmlqError(
            f"Unknown model {target!r}: give a sample ({', '.join(sorted(found)) or 'none installed'}) "
            "or module:function returning (model, example_inputs, variables)."
        )
    module_name, _, function_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise OdmlqError(f"Cannot import module {module_name!r} from {target!r}: {e}.") from None
    fn = getattr(module, function_name, None)
    if not callable(fn):
        raise OdmlqError(f"{target!r}: module {module_name!r} has no function {function_name!r}.")
    result = fn()
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise OdmlqError(
            f"{target!r} returned {type(result).__name__}; it must return "
            "(model, example_inputs) or (model, example_inputs, variables)."
        )
    model, inputs, variables = (*result, None)[:3]
    if not isinstance(inputs, (tuple, list)):
        inputs = (inputs,)
    return model, tuple(inputs), variables


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


def rules_from(path: str | None):
    """Rules from a file, or the default rule (said on stderr)."""
    from odmlq.rules import Rule, load_rules

    if path:
        return load_rules(path)
    print(f"# no --rules given: {DEFAULT_RULES}", file=sys.stderr)
    return [Rule(".*", weight_qtype="int8", act_qtype="int8")]


def load_calibration(path: str | None):
    from odmlq.calibration import Calibration

    if path is None:
        return None
    if not os.path.isfile(path):
        raise OdmlqError(f"Cannot read calibration {path!r}: no such file; give the .npz Calibration.save "
                         "(or odmlq export --save-calibration) wrote.")
    return Calibration.load(path)


def read_model_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise OdmlqError(f"Cannot read model {path!r}: {e.strerror}; give a .tflite file.") from None


def writable(*paths: str | None) -> None:
    """Every output path given can be written (before any work)."""
    from odmlq.files import check_output_path

    for path in paths:
        if path is not None:
            check_output_path(path)


@contextlib.contextmanager
def warnings_on_stderr() -> Iterator[None]:
    """Python warnings raised inside, printed as ``warning: ...`` lines."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
