"""How many scales a quantized tensor has, and along which axes.

- `PerTensor()`: one scale for the whole tensor.
- `PerChannel(axis)`: one scale per index of `axis`. With `axis=None` (the
  default) the plan picks the op's output-channel axes for weights (the
  non-contracting kernel axes of a dot, the output-feature axis of a conv).
- `PerBlock(size)`: one scale per `size` consecutive elements along the
  contraction axis of a weight (within each output channel); `axis` overrides.

These are requests. The plan resolves them against each tensor's shape into
explicit axes, and rejects what does not fit (a block size that does not
divide the axis, an axis out of range).
"""

from __future__ import annotations

import dataclasses

from odmlq.errors import GranularityError

__all__ = ["Granularity", "PerTensor", "PerChannel", "PerBlock", "granularity_from_dict"]


@dataclasses.dataclass(frozen=True)
class PerTensor:
    """One scale (and zero point) for the whole tensor."""

    def to_dict(self) -> dict:
        return {"kind": "per_tensor"}


@dataclasses.dataclass(frozen=True)
class PerChannel:
    """One scale per index along `axis` (None: the op's output channels)."""

    axis: int | None = None

    def __post_init__(self):
        if self.axis is not None and not isinstance(self.axis, int):
            raise GranularityError(
                f"PerChannel(axis={self.axis!r}): axis must be an int or None."
            )

    def to_dict(self) -> dict:
        return {"kind": "per_channel", "axis": self.axis}


@dataclasses.dataclass(frozen=True)
class PerBlock:
    """One scale per `size` consecutive elements along the contraction axis."""

    size: int
    axis: int | None = None

    def __post_init__(self):
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise GranularityError(
                f"PerBlock(size={self.size!r}): size must be a positive int, e.g. PerBlock(32)."
            )
        if self.axis is not None and not isinstance(self.axis, int):
            raise GranularityError(
                f"PerBlock(axis={self.axis!r}): axis must be an int or None."
            )

    def to_dict(self) -> dict:
        return {"kind": "per_block", "size": self.size, "axis": self.axis}


Granularity = PerTensor | PerChannel | PerBlock


def granularity_from_dict(data: dict | str) -> Granularity:
    """Inverse of `to_dict`; also accepts 'per_tensor' / 'per_channel'."""
    if isinstance(data, str):
        data = {"kind": data}
    if not isinstance(data, dict) or "kind" not in data:
        raise GranularityError(
            f"Granularity {data!r} is not understood; write e.g. "
            "{'kind': 'per_block', 'size': 32} or 'per_channel'."
        )
    kind = data["kind"]
    rest = {k: v for k, v in data.items() if k != "kind"}
    classes = {"per_tensor": PerTensor, "per_channel": PerChannel, "per_block": PerBlock}
    if kind not in classes:
        raise GranularityError(
            f"Unknown granularity kind {kind!r}; choose one of {sorted(classes)}."
        )
    try:
        return classes[kind](**rest)
    except TypeError as e:
        raise GranularityError(f"Granularity {data!r}: {e}.") from None
