"""QType: a value object that stands for its canonical name."""

import pytest

import odmlq
from odmlq.plan import QuantSpec
from odmlq.qtypes import QTYPES, qtype


def test_a_qtype_equals_and_hashes_like_its_name():
    int8 = qtype("int8")
    assert int8 == "int8" and "int8" == int8 and int8 != "int16" and int8 != qtype("int4")
    assert {"int8": 1}[int8] == 1 and int8 in {"int8", "int16"} and int8 in ("int4", "int8")
    assert str(int8) == "int8" and f"{int8}" == "int8" and repr(int8) == "'int8'"


@pytest.mark.parametrize("alias,name", [("i8", "int8"), ("e4m3", "fp8_e4m3"), ("INT16", "int16")])
def test_specs_hold_qtype_objects_from_names_and_aliases(alias, name):
    spec = QuantSpec(qtype=alias)
    assert spec.qtype is QTYPES[name]
    assert spec.to_dict()["qtype"] == name and QuantSpec.from_dict(spec.to_dict()) == spec


def test_an_unknown_qtype_lists_the_valid_ones():
    with pytest.raises(odmlq.QTypeError, match=r"Unknown qtype 'int9'; choose one of \["):
        QuantSpec(qtype="int9")
