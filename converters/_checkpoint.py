"""What every converter shares: its errors and the check of checkpoint names against a model."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np

from odmlq import OdmlqError

__all__ = ["CheckpointError", "ModelFilesError", "check_names", "nest"]


class CheckpointError(OdmlqError, KeyError):
    """Checkpoint entries that do not fit the model: missing, unexpected or misshapen.

    Attributes:
      missing: checkpoint names the model needs and the checkpoint lacks.
      unexpected: checkpoint names the model has no place for.
      mismatched: ``(name, checkpoint shape, expected shape)`` triples.
    """

    def __init__(self, message: str, *, missing=(), unexpected=(), mismatched=()):
        super().__init__(message)
        self.missing, self.unexpected, self.mismatched = tuple(missing), tuple(unexpected), tuple(mismatched)

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


class ModelFilesError(OdmlqError, FileNotFoundError):
    """The checkpoint, or a file the converter needs beside it, is not there."""


def check_names(checkpoint: Mapping[str, object], expected: Mapping[str, tuple[int, ...]], *,
                ignored: Collection[str] = (), source: str, model: str, fix: str) -> None:
    """Raises `CheckpointError` listing every missing, unexpected and misshapen name at once.

    Args:
      checkpoint: name -> array (anything with a shape).
      expected: name -> the shape the model needs.
      ignored: names read and dropped on purpose.
      source, model: the file and the model, for the message.
      fix: the sentence that ends the message (what to do).
    """
    missing = sorted(set(expected) - set(checkpoint))
    unexpected = sorted(set(checkpoint) - set(expected) - set(ignored))
    mismatched = sorted((name, tuple(np.shape(checkpoint[name])), tuple(expected[name]))
                        for name in set(expected) & set(checkpoint)
                        if tuple(np.shape(checkpoint[name])) != tuple(expected[name]))
    if not (missing or unexpected or mismatched):
        return
    parts = []
    if missing:
        parts.append(f"missing keys ({len(missing)}): {', '.join(missing)}")
    if unexpected:
        parts.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected)}")
    if mismatched:
        parts.append(f"shape mismatches ({len(mismatched)}): " + ", ".join(
            f"{name} is {got}, expected {want}" for name, got, want in mismatched))
    raise CheckpointError(f"{source} does not fit {model}: " + "; ".join(parts) + f". {fix}",
                          missing=missing, unexpected=unexpected, mismatched=mismatched)


def nest(tree: dict, path: tuple[str, ...], value) -> None:
    """Puts `value` at `path` in a nested dict, creating the levels on the way."""
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value
