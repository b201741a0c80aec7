"""Quantized types: what each stores, its range, and where it runs natively.

A `QType` is a value object; look one up by name with `qtype('int8')`.
Integer types are signed two's complement. `narrow_range` (used for weights)
drops the most negative code so that the range is symmetric: int8 weights use
[-127, 127], which LiteRT requires of int8 weights.

Native means a backend computes on the stored values directly (integer
dot/conv, fp8 dot); anything else is *emulated*: stored quantized, dequantized
to float before the op. A plan says which, per backend; nothing is emulated
silently.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import ml_dtypes
import numpy as np

from odmlq.errors import QTypeError

__all__ = ["QType", "qtype", "QTYPES", "NF4_LEVELS", "BACKENDS"]

BACKENDS = ("xla", "litert")

# The 16 NormalFloat levels of QLoRA: quantiles of N(0, 1) rescaled to [-1, 1],
# with an exact zero.
# References: Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs",
# 2023, appendix E.
NF4_LEVELS = np.array(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
        0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
        0.7229568362236023, 1.0,
    ],
    dtype=np.float32,
)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class QType:
    """A quantized number format.

    A QType is equal to (and hashes like) its canonical name, so
    ``spec.qtype == 'int8'`` and a table keyed by names both work; it prints
    as its name.

    Attributes:
      name: canonical name, e.g. ``'int8'``, ``'fp8_e4m3'``, ``'nf4'``.
      kind: ``'int'`` (uniform integer grid), ``'float'`` (fp8) or ``'lut'``
        (a lookup table of levels, nf4).
      bits: bits per value.
      qmin, qmax: the representable range of the stored value. For integers
        the integer codes; for fp8 the largest finite magnitude; for nf4 the
        table's range, [-1, 1].
      storage_dtype: numpy dtype of one stored value before packing.
      values_per_byte: >1 when values are packed into bytes (int4 and nf4 two
        per byte, int2 four per byte).
      native: backends that compute on this type without dequantizing first.
    """

    name: str
    kind: Literal["int", "float", "lut"]
    bits: int
    qmin: float
    qmax: float
    storage_dtype: np.dtype
    values_per_byte: int = 1
    native: frozenset[str] = frozenset()

    @property
    def is_integer(self) -> bool:
        return self.kind == "int"

    def range(self, narrow_range: bool = False) -> tuple[float, float]:
        """(qmin, qmax), with the most negative integer code dropped if narrow."""
        if narrow_range and self.kind == "int":
            return self.qmin + 1, self.qmax
        return self.qmin, self.qmax

    def runs_natively_on(self, backend: str) -> bool:
        if backend not in BACKENDS:
            raise QTypeError(f"Unknown backend {backend!r}; choose one of {BACKENDS}.")
        return backend in self.native

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        # As its name: reprs of specs and messages read qtype='int8'.
        return repr(self.name)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, QType):
            return self.name == other.name
        if isinstance(other, str):
            return self.name == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)


def _int(bits: int, native: tuple[str, ...] = ()) -> QType:
    per_byte = 8 // bits if bits < 8 and 8 % bits == 0 else 1
    return QType(
        name=f"int{bits}",
        kind="int",
        bits=bits,
        qmin=float(-(2 ** (bits - 1))),
        qmax=float(2 ** (bits - 1) - 1),
        storage_dtype=np.dtype(np.int16 if bits > 8 else np.int8),
        values_per_byte=per_byte,
        native=frozenset(native),
    )


QTYPES: dict[str, QType] = {
    "int2": _int(2),
    "int3": _int(3),
    "int4": _int(4, ("xla", "litert")),
    "int5": _int(5),
    "int6": _int(6),
    "int7": _int(7),
    "int8": _int(8, ("xla", "litert")),
    "int16": _int(16, ("litert",)),
    "fp8_e4m3": QType(
        name="fp8_e4m3",
        kind="float",
        bits=8,
        qmin=-float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max),
        qmax=float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max),
        storage_dtype=np.dtype(ml_dtypes.float8_e4m3fn),
        native=frozenset({"xla"}),
    ),
    "fp8_e5m2": QType(
        name="fp8_e5m2",
        kind="float",
        bits=8,
        qmin=-float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max),
        qmax=float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max),
        storage_dtype=np.dtype(ml_dtypes.float8_e5m2),
        native=frozenset({"xla"}),
    ),
    "nf4": QType(
        name="nf4",
        kind="lut",
        bits=4,
        qmin=-1.0,
        qmax=1.0,
        storage_dtype=np.dtype(np.uint8),
        values_per_byte=2,
    ),
}

_ALIASES = {
    "i8": "int8", "i4": "int4", "i16": "int16", "s8": "int8", "s4": "int4",
    "float8_e4m3fn": "fp8_e4m3", "e4m3": "fp8_e4m3", "fp8": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2", "e5m2": "fp8_e5m2",
}


def qtype(name: str | QType) -> QType:
    """Looks up a QType by name (or passes one through).

    Example:
      >>> qtype('int8').range(narrow_range=True)
      (-127.0, 127.0)
    """
    if isinstance(name, QType):
        return name
    if not isinstance(name, str):
        raise QTypeError(f"A qtype is given by name (a string), got {name!r}.")
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in QTYPES:
        raise QTypeError(
            f"Unknown qtype {name!r}; choose one of {sorted(QTYPES)}."
        )
    return QTYPES[key]
