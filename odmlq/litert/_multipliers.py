"""LiteRT's quantized ADD and SUB rescale their inputs and output through
fixed-point multipliers that must be below 1 (internal; used by `_prepare`).

``tensorflow/lite/kernels/add.cc`` (and sub.cc) take ``twice = 2 max(s_1,
s_2)`` and the output multiplier ``twice / (2^k s_out)``, k = 15 for int16
and 20 for int8, through ``QuantizeMultiplierSmallerThanOneExp``, which
checks it is below 1 and aborts the process otherwise: LiteRT dies loading
the file. An input whose one step is 2^(k-1) output steps or more breaks it:
a tensor that is all zeros in calibration (a zero-initialized table, whose
scale defaults to 1) added to small values, measured on transformers'
BEiT at int16 (its relative position bias tables initialize to zeros).
Refused here, by name, before conversion."""

from __future__ import annotations

import numpy as np

from odmlq.errors import PlanError

_LEFT_SHIFT = {"int8": 20, "int16": 15}


def _operand_scale(plan, scales, op, index: int, operand):
    if operand.role == "input" and operand.edge is not None:
        return scales.input_scale(plan, op, operand.edge), f"edge {plan.graph.resolve(operand.edge)!r}"
    if operand.role in ("weight", "bias") and operand.param is not None:
        derived = scales.derived.get((op.id, index))  # computed from parameters, read as a constant
        return (derived or scales.weights.get(operand.param),
                f"{'a value derived from ' if derived else ''}parameter {operand.param!r}")
    # Constants are keyed by their index among the op's constants, not its operands.
    position = sum(1 for o in op.operands[:index] if o.role == "constant")
    return scales.constants.get((op.id, position)), f"constant operand {index}"


def check_add_multipliers(plan, scales) -> None:
    """Raises PlanError for the first quantized ADD or SUB whose output
    multiplier would be 1 or more (see the module doc), naming the input."""
    for op in plan.graph.ops:
        if op.kind not in ("add", "sub") or len(op.outputs) != 1:
            continue
        out = scales.edges.get(op.outputs[0])
        if out is None or str(out.qtype) not in _LEFT_SHIFT or out.scale_axes:
            continue
        read = [(_operand_scale(plan, scales, op, i, o), o) for i, o in enumerate(op.operands)]
        read = [(ts, name) for (ts, name), _ in read if ts is not None and not ts.scale_axes]
        if len(read) != 2:
            continue
        shift = _LEFT_SHIFT[str(out.qtype)]
        out_scale = float(np.max(out.scale))
        (ts, name) = max(read, key=lambda r: float(np.max(r[0].scale)))
        largest = float(np.max(ts.scale))
        if 2.0 * largest < (1 << shift) * out_scale:
            continue
        qtype = str(out.qtype)
        path = op.module_path
        int8 = (f"Rule({path!r}, weight_qtype='int8', act_qtype='int8')" if path
                else "an int8 rule for the op (it is at the model's top level)")
        skip = f"Rule({path!r}, skip=True)" if path else "a skip rule for the op"
        fix = (f"{int8} before your rules gives it {2 ** (20 - 15)}x more room, " if qtype == "int16" else "")
        raise PlanError(
            f"op {op.id!r} (module {path!r}): LiteRT's {qtype} {op.kind.upper()} rescales its inputs "
            f"to its output through a multiplier below 1, and its input {name} has scale {largest:.3g} over an "
            f"output scale of {out_scale:.3g} (one input step is {largest / out_scale:.3g} output steps; at most "
            f"{2 ** (shift - 1)}): LiteRT would abort loading the file. A scale of 1 is a range of zero in "
            "calibration (an activation all zeros on the calibration data, or a parameter all zeros, as a "
            f"freshly initialized bias table is: export the trained weights). Otherwise {fix}or keep the op "
            f"in float with {skip} and allow_float_ops=True.")
