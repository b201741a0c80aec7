"""QuantSpec: how one tensor is quantized, resolved against its shape.

The plan gives one to every quantized weight, edge and constant operand;
backends read it and never re-decide.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from odmlq import calibration as calibration_lib
from odmlq.algorithms import parse_weight_algorithm
from odmlq.qtypes import BACKENDS, QType, qtype as lookup_qtype

__all__ = ["QuantSpec", "spec_or_none"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """How one tensor is quantized, fully resolved against its shape.

    Attributes:
      qtype: the `QType` (a name is looked up).
      scale_axes: axes along which the scale varies (() is per-tensor).
      block_axis, block_size: blockwise scales along `block_axis`.
      symmetric: no zero point.
      narrow_range: int codes in [-qmax, qmax] (symmetric int weights).
      calibration: how the range is chosen (None for dynamic activations).
      dynamic: the range is taken from the tensor itself at run time.
      algorithm: how a weight's values are rounded to the grid (`odmlq.GPTQ`);
        None: to nearest.
      scale_dtype: how the scales are stored: 'float32', 'float16' (each
        scale rounded up to a float16), or 'bfloat16' (rounded up to a value
        bfloat16 and float16 both hold: LiteRT stores block scales as float16
        and XNNPACK's blockwise kernels read them as bfloat16).
    """

    qtype: QType
    scale_axes: tuple[int, ...] = ()
    block_axis: int | None = None
    block_size: int | None = None
    symmetric: bool = True
    narrow_range: bool = False
    calibration: Any = None
    dynamic: bool = False
    algorithm: Any = None
    scale_dtype: str = "float32"

    def __post_init__(self):
        object.__setattr__(self, "qtype", lookup_qtype(self.qtype))
        if self.algorithm is not None:
            object.__setattr__(self, "algorithm", parse_weight_algorithm(self.algorithm))

    def describe(self) -> str:
        if self.block_size is not None:
            gran = f"block({self.block_size}, axis={self.block_axis})"
            if self.scale_axes:
                gran += f" channels{list(self.scale_axes)}"
        elif self.scale_axes:
            gran = f"per-channel{list(self.scale_axes)}"
        else:
            gran = "per-tensor"
        parts = [self.qtype.name, gran, "sym" if self.symmetric else "asym"]
        if self.narrow_range:
            parts.append("narrow")
        if self.dynamic:
            parts.append("dynamic")
        elif self.calibration is not None:
            parts.append(_method_str(self.calibration))
        if self.algorithm is not None:
            parts.append(_method_str(self.algorithm, "algorithm"))
        if self.scale_dtype != "float32":
            parts.append(f"{self.scale_dtype} scales")
        emulated = [b for b in BACKENDS if not self.qtype.runs_natively_on(b)]
        if emulated:
            parts.append(f"(emulated on {'/'.join(emulated)})")
        return " ".join(parts)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["qtype"] = self.qtype.name
        d["scale_axes"] = list(self.scale_axes)
        d["calibration"] = None if self.calibration is None else self.calibration.to_dict()
        d["algorithm"] = None if self.algorithm is None else self.algorithm.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "QuantSpec":
        d = dict(d)
        d["scale_axes"] = tuple(d["scale_axes"])
        if d.get("calibration") is not None:
            d["calibration"] = calibration_lib.parse_calibration_method(d["calibration"])
        return cls(**d)


def _method_str(method, key: str = "method") -> str:
    d = method.to_dict()
    name = d.pop(key)
    return name + (f"({', '.join(f'{k}={v}' for k, v in d.items())})" if d else "")


def spec_or_none(d):
    return None if d is None else QuantSpec.from_dict(d)
