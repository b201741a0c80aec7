"""The constraint vocabulary: resolution per op and qtype, combination of
targets, serialization."""

import dataclasses

import pytest

from odmlq.constraints import (
    FixedOutput, FixedScale, OpConstraints, Rounding, SameAsInput, SharedWithInputs, Target,
    combine_targets, constraint_from_dict,
)
from odmlq.errors import PlanError


@dataclasses.dataclass
class _Op:
    id: str
    kind: str
    module_path: str = "m"


FIXED = FixedOutput({"int8": FixedScale(1 / 256, -128)})


def test_fixed_output_resolves_per_qtype():
    entry = OpConstraints(output=FIXED)
    assert entry.resolve(_Op("a", "logistic"), "int8") == FixedScale(1 / 256, -128)
    assert entry.resolve(_Op("a", "logistic"), "int16") is None  # no fixed scale: calibrated


def test_same_as_input_takes_its_rounding_from_the_op():
    entry = OpConstraints(output=SameAsInput(),
                          rounding=lambda op, qtype: Rounding.HALF_AWAY if qtype == "int16" else Rounding.HALF_EVEN)
    assert entry.resolve(_Op("p", "avg_pool"), "int16") == SameAsInput(Rounding.HALF_AWAY)
    assert entry.resolve(_Op("p", "avg_pool"), "int8") == SameAsInput(Rounding.HALF_EVEN)


def test_targets_combine_and_a_conflict_is_named():
    a = Target(name="a", ops={"relu": OpConstraints(output=SameAsInput(), fuses=frozenset())},)
    b = Target(name="b", ops={"dense": OpConstraints(fuses=frozenset({"relu"}))})
    resolve = combine_targets([a, b])
    assert resolve(_Op("r", "relu"), "int8") == (SameAsInput(), frozenset())
    assert resolve(_Op("d", "dense"), "int8") == (None, frozenset({"relu"}))
    c = Target(name="c", ops={"relu": OpConstraints(output=SharedWithInputs())})
    with pytest.raises(PlanError, match=r"op 'r' \(module 'm'\): target 'a' requires .* and target 'c'"):
        combine_targets([a, c])(_Op("r", "relu"), "int8")


@pytest.mark.parametrize("constraint", [SameAsInput(), SameAsInput(Rounding.HALF_AWAY), SharedWithInputs(),
                                        FixedScale(0.5, 3)], ids=repr)
def test_dict_round_trip(constraint):
    assert constraint_from_dict(constraint.to_dict()) == constraint
    assert constraint_from_dict(None) is None


def test_an_unknown_serialized_constraint_is_refused():
    with pytest.raises(PlanError, match="Unknown edge constraint"):
        constraint_from_dict({"kind": "tiled"})
