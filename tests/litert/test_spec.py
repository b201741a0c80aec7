"""LiteRT's op table and the target built from it."""

import dataclasses

import pytest

from odmlq.constraints import FixedScale, Rounding, SameAsInput, SharedWithInputs
from odmlq.litert.spec import OP_SPEC, TARGET


@dataclasses.dataclass
class _Op:
    id: str
    kind: str
    module_path: str = "m"
    attributes: dict = dataclasses.field(default_factory=dict)


def test_the_target_holds_every_kind_of_the_table():
    assert TARGET.name == "litert" and set(TARGET.ops) == set(OP_SPEC)
    assert TARGET.weight_channel_axes == 1  # one quantized dimension per tensor


@pytest.mark.parametrize("kind", sorted(OP_SPEC))
def test_every_entry_resolves_for_each_qtype_it_has_a_kernel_for(kind):
    op = _Op(id=f"x/{kind}", kind=kind, attributes={"window": [1, 2, 2, 1], "strides": [1, 2, 2, 1],
                                                      "padding": [[0, 0]] * 4, "dilated": False})
    for qtype in OP_SPEC[kind].schemas:
        resolved = TARGET.constraints_of(kind).resolve(op, qtype)
        assert resolved is None or isinstance(resolved, (SameAsInput, SharedWithInputs, FixedScale))


def test_fixed_scales_are_the_kernels_own():
    sigmoid = TARGET.constraints_of("logistic")
    assert sigmoid.resolve(_Op("s", "logistic"), "int8") == FixedScale(1 / 256, -128)
    assert sigmoid.resolve(_Op("s", "logistic"), "int16") == FixedScale(1 / 32768, 0)
    assert TARGET.constraints_of("tanh").resolve(_Op("t", "tanh"), "int8") == FixedScale(1 / 128, 0)


def test_an_average_pool_rounds_as_its_lowering_does():
    unpadded = _Op("p", "avg_pool", attributes={"window": [1, 2, 2, 1], "strides": [1, 2, 2, 1],
                                                 "padding": [[0, 0]] * 4, "dilated": False})
    padded = dataclasses.replace(unpadded, attributes={**unpadded.attributes, "padding": [[0, 0], [1, 1], [1, 1], [0, 0]]})
    entry = TARGET.constraints_of("avg_pool")
    assert entry.resolve(unpadded, "int8") == SameAsInput(Rounding.HALF_EVEN)  # a depthwise convolution
    assert entry.resolve(padded, "int8") == SameAsInput(Rounding.HALF_AWAY)  # AVERAGE_POOL_2D


def test_matmuls_and_elementwise_kernels_fuse_relu():
    for kind in ("dot_general", "conv", "einsum", "add", "sub", "mul"):
        assert TARGET.constraints_of(kind).fuses == frozenset({"relu", "relu6"})
