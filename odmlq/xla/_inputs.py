"""How an op reads its quantized inputs on XLA: at the edge's spec and scale,
or through a conversion (`Plan.conversions`) at the conversion's.

Internal; `odmlq.xla._lowering` picks each op's kernel from the `Input` its
matmul or convolution reads. Conversions are looked up with
`odmlq.plan._conversions.input_conversion_scales`, so XLA reads each converted input
at the very scale `simulate` does.
"""

from __future__ import annotations

import dataclasses

from odmlq.errors import PlanError
from odmlq.plan import QuantSpec
from odmlq.scales import TensorScale
from odmlq.plan import input_conversion_scales


@dataclasses.dataclass(frozen=True)
class Input:
    """How an op reads one quantized input: the spec and, when static, the
    `TensorScale` of the edge, or of the conversion it is read through."""

    edge: str
    spec: QuantSpec
    scale: TensorScale | None  # None when dynamic
    converted_from: str | None = None  # the edge's own qtype or 'float', when converted

    def describe(self) -> str:
        if self.converted_from is None:
            return ""
        return f"; reads {self.edge} as {self.spec.qtype}, converted from {self.converted_from}"


def converted_inputs(plan, scales) -> dict[str, dict[int, Input]]:
    """op id -> {operand index: `Input`} of the inputs each op reads through a
    conversion (`Plan.conversions`), at the scales `simulate` reads them at.

    Raises:
      PlanError: `scales` lack the scale of one of the plan's conversions (they
        were computed for another plan); the op would read the edge at another
        scale than `simulate`.
    """
    missing = [key for key in plan.conversions if key not in scales.conversions]
    if missing:
        edge, qtype = missing[0]
        consumers = ", ".join(plan.conversions[missing[0]].consumers)
        raise PlanError(
            f"The scales have no conversion scale for edge {edge!r} read as {qtype} by {consumers} "
            f"({len(missing)} of the plan's {len(plan.conversions)} conversions missing); compute "
            "them for this plan: odmlq.compute_scales(plan, calibration, params).")
    out: dict[str, dict[int, Input]] = {}
    for op_id, pairs in input_conversion_scales(plan, scales).items():
        op = plan.graph.op(op_id)
        for index, ts in pairs:
            edge = plan.graph.resolve(op.operands[index].edge)
            conversion = plan.conversions[(edge, ts.qtype)]
            out.setdefault(op_id, {})[index] = Input(edge=edge, spec=conversion.spec, scale=ts,
                                                     converted_from=conversion.source)
    return out

