"""The vocabulary of scale constraints a target's kernels put on tensor edges.

A target (LiteRT, XLA) describes, per op kind, what its integer kernels
require of the op's output scale and which following activations they fuse
(`OpConstraints`, gathered in a `Target`). `odmlq.plan(..., target=...)`
resolves those requirements into every edge of the Plan (`EdgePlan.constraint`,
`EdgePlan.fused_into`), so scales, simulate, both backends and the report read
the same resolved Plan and none of them consults a target's table again.

Resolved constraints on an edge:

- `SameAsInput`: the output has its input's scale and zero point (the op
  moves values and never rescales: reshape, transpose, max pool, an average
  pool, which may round its sum its own way, see `Rounding`).
- `SharedWithInputs`: every input is read at the output's scale (kernels
  like a concatenation or an elementwise maximum).
- `FixedScale`: the kernel fixes the output's scale and zero point
  (logistic and softmax into [0, 1], tanh into [-1, 1]).

The tables themselves live with each backend; this module holds no fact about
any kernel.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from odmlq.errors import PlanError

__all__ = [
    "Constraint", "FixedOutput", "FixedScale", "OpConstraints", "Rounding", "SameAsInput",
    "SharedWithInputs", "Target", "constraint_from_dict", "combine_targets",
]


class Rounding(enum.Enum):
    """How a kernel rounds a value that falls halfway between two steps."""

    HALF_EVEN = "half_even"  # requantizing kernels, `odmlq.qarray`
    HALF_AWAY = "half_away"  # an integer sum divided by a count, rounded away from zero


@dataclasses.dataclass(frozen=True)
class SameAsInput:
    """The output shares its (first quantized) input's scale and zero point."""

    rounding: Rounding = Rounding.HALF_EVEN

    def to_dict(self) -> dict:
        return {"kind": "same_as_input", "rounding": self.rounding.value}


@dataclasses.dataclass(frozen=True)
class SharedWithInputs:
    """Every input is read at the output's scale; the producers of inputs this
    op alone reads write at that scale (a requantization folded into them)."""

    def to_dict(self) -> dict:
        return {"kind": "shared_with_inputs"}


@dataclasses.dataclass(frozen=True)
class FixedScale:
    """The kernel's output scale and zero point, fixed."""

    scale: float
    zero_point: int

    def to_dict(self) -> dict:
        return {"kind": "fixed", "scale": self.scale, "zero_point": self.zero_point}


Constraint = SameAsInput | SharedWithInputs | FixedScale


def constraint_from_dict(d: dict | None) -> Constraint | None:
    if d is None:
        return None
    kind = d.get("kind")
    if kind == "same_as_input":
        return SameAsInput(Rounding(d.get("rounding", "half_even")))
    if kind == "shared_with_inputs":
        return SharedWithInputs()
    if kind == "fixed":
        return FixedScale(float(d["scale"]), int(d["zero_point"]))
    raise PlanError(f"Unknown edge constraint {d!r} in a serialized plan; re-create the plan.")


@dataclasses.dataclass(frozen=True)
class FixedOutput:
    """In a target's table: the fixed output scale per activation qtype name."""

    scales: Mapping[str, FixedScale]

    def for_qtype(self, qtype: str) -> FixedScale | None:
        return self.scales.get(qtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpConstraints:
    """What a target's kernel for one op kind requires of its output.

    Attributes:
      output: None (free: calibrated), `SameAsInput`, `SharedWithInputs` or a
        `FixedOutput`.
      rounding: for `SameAsInput` outputs, how the kernel rounds; a
        `Rounding` or ``rounding(op, qtype) -> Rounding`` when it depends on
        the op (an average pool lowered one way or another).
      fuses: kinds of activations the kernel applies before requantizing its
        result (the tensor between them is never materialized).
    """

    output: SameAsInput | SharedWithInputs | FixedOutput | None = None
    rounding: Rounding | Callable[[Any, str], Rounding] = Rounding.HALF_EVEN
    fuses: frozenset[str] = frozenset()

    def resolve(self, op, qtype: str) -> Constraint | None:
        """The constraint on this op's output edge of activation qtype `qtype`."""
        if isinstance(self.output, FixedOutput):
            return self.output.for_qtype(qtype)
        if isinstance(self.output, SameAsInput):
            rounding = self.rounding(op, qtype) if callable(self.rounding) else self.rounding
            return SameAsInput(rounding)
        return self.output


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """A backend's scale constraints, by op kind (kinds not listed are free).

    Example:
      >>> odmlq.plan(model, rules, x, target="litert")   # the face names targets
    """

    name: str
    ops: Mapping[str, OpConstraints] = dataclasses.field(default_factory=dict)
    # The most axes a weight's per-channel scales may run along (None: any).
    weight_channel_axes: int | None = None
    # Whether a dynamically quantized input needs a kernel that reads a
    # quantized constant weight (LiteRT's dynamic-range kernels): an
    # activation x activation matmul then reads its dynamic inputs in float.
    dynamic_inputs_need_weight: bool = False
    # Whether a dynamic rule leaves a depthwise convolution's weight float:
    # LiteRT's hybrid depthwise kernel runs outside XNNPACK, slower than the
    # float one XNNPACK runs (and the weight is a small share of a model's).
    dynamic_depthwise_float: bool = False
    # How the target stores a weight's block scales ('float16', 'bfloat16':
    # see `QuantSpec.scale_dtype`); None: as computed (float32).
    block_scale_dtype: str | None = None
    # Whether a dynamic-range matmul quantizes its input per row, every axis
    # but the contracted ones with its own range (LiteRT's hybrid
    # FULLY_CONNECTED and XNNPACK's qd8 kernels), where a rule asks for one
    # range per tensor.
    dynamic_inputs_per_row: bool = False
    # The qtype a float model input is carried in where only float ops read
    # it and a statically quantized convolution lies downstream of them:
    # litert-converter 0.5.0 fuses such a convolution into an integer kernel
    # only when the float ops before it read a quantized model input (else it
    # keeps the convolution float, its filter dequantized at every invoke).
    # None: the input stays float.
    float_input_carrier: str | None = None
    # Op kinds the target computes in float only (LiteRT's SIN, COS, ELU...,
    # run on dequantized values where float ops are allowed): values computed
    # from integer inputs alone that only such ops read are kept float
    # (`plan/_passes.float_from_integers`), not quantized before them.
    float_kinds: frozenset[str] = frozenset()

    def constraints_of(self, kind: str) -> OpConstraints | None:
        return self.ops.get(kind)


def combine_targets(targets: Sequence[Target]) -> Callable[[Any, str], tuple[Constraint | None, frozenset]]:
    """``(op, qtype) -> (output constraint, fused activation kinds)`` honouring
    every target: a model planned for two targets computes the same numbers on
    both, so their constraints must agree where both have one.

    Raises:
      PlanError: two targets require different output constraints of one op.
    """
    targets = tuple(targets)

    def resolve(op, qtype: str):
        constraint, fuses, source = None, frozenset(), None
        for target in targets:
            entry = target.constraints_of(op.kind)
            if entry is None:
                continue
            fuses = fuses | entry.fuses
            resolved = entry.resolve(op, qtype)
            if resolved is None:
                continue
            if constraint is not None and resolved != constraint:
                raise PlanError(
                    f"op {op.id!r} (module {op.module_path!r}): target {source!r} requires "
                    f"{constraint} of its output and target {target.name!r} {resolved}; plan for "
                    "one target at a time.")
            constraint, source = resolved, target.name
        return constraint, fuses

    return resolve
