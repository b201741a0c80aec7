"""LiteRT's quantization spec, in one table.

For each op kind of a plan: whether LiteRT has an integer kernel for it (in
the int8 and int16x8 schemas) and what that kernel requires of its output's
scale and zero point:

- ``SAME_AS_INPUT``: the output shares the input's scale and zero point
  (LiteRT's reshape, transpose, max pool, ... move values, never rescale).
- ``Fixed``: the output range is fixed by the kernel (logistic, tanh,
  softmax compute into [0, 1] or [-1, 1] with a fixed scale).
- ``None``: free, taken from calibration.

References: LiteRT 8-bit quantization specification
(ai.google.dev/edge/litert/models/quantization_spec) and the int16x8
kernels' zero-point-0 requirement.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Fixed:
    """A fixed output (scale, zero point) per activation qtype."""

    params: dict  # qtype name -> (scale, zero_point)


SAME_AS_INPUT = "same_as_input"

_SIGMOID_LIKE = Fixed({"int8": (1.0 / 256.0, -128), "int16": (1.0 / 32768.0, 0)})
_TANH_LIKE = Fixed({"int8": (1.0 / 128.0, 0), "int16": (1.0 / 32768.0, 0)})

# op kind -> (schemas with an integer kernel, output constraint)
OP_SPEC: dict[str, tuple[frozenset[str], object]] = {
    "dot_general": (frozenset({"int8", "int16"}), None),
    "einsum": (frozenset({"int8", "int16"}), None),
    "conv": (frozenset({"int8", "int16"}), None),
    "add": (frozenset({"int8", "int16"}), None),
    "sub": (frozenset({"int8", "int16"}), None),
    "mul": (frozenset({"int8", "int16"}), None),
    "relu": (frozenset({"int8", "int16"}), None),
    "relu6": (frozenset({"int8", "int16"}), None),
    "max": (frozenset({"int8", "int16"}), None),
    "min": (frozenset({"int8", "int16"}), None),
    "avg_pool": (frozenset({"int8", "int16"}), SAME_AS_INPUT),
    "reduce_sum": (frozenset({"int8", "int16"}), None),
    "mean": (frozenset({"int8", "int16"}), None),
    "tanh": (frozenset({"int8", "int16"}), _TANH_LIKE),
    "logistic": (frozenset({"int8", "int16"}), _SIGMOID_LIKE),
    "sigmoid": (frozenset({"int8", "int16"}), _SIGMOID_LIKE),
    "softmax": (frozenset({"int8", "int16"}), _SIGMOID_LIKE),
    "reshape": (frozenset({"int8", "int16"}), SAME_AS_INPUT),
    "squeeze": (frozenset({"int8", "int16"}), SAME_AS_INPUT),
    "transpose": (frozenset({"int8", "int16"}), SAME_AS_INPUT),
    "broadcast_in_dim": (frozenset({"int8", "int16"}), SAME_AS_INPUT),
    "max_pool": (frozenset({"int8", "int16"}), SAME_AS_INPUT),
    "slice": (frozenset({"int8", "int16"}), SAME_AS_INPUT),
    "pad": (frozenset({"int8", "int16"}), SAME_AS_INPUT),
    "concatenate": (frozenset({"int8", "int16"}), None),
}


def output_constraint(kind: str):
    """The scale constraint of `kind`'s output (None: free)."""
    entry = OP_SPEC.get(kind)
    return None if entry is None else entry[1]
