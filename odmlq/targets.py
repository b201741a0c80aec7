"""Named targets, and the face's `plan` and `ptq`, which default to both.

A plan is made for one or more targets, and their scale constraints are
resolved into it (`odmlq.constraints`): ``'litert'`` (LiteRT's integer
kernels: fixed, shared and same-as-input output scales, fused activations),
``'xla'`` (no constraint: every scale calibrated) or ``'both'`` (the default:
a model quantized once computes the same numbers on XLA and in the .tflite).
This module composes the backends' targets, so neither backend imports the
other; it belongs to the face (never imported by the rest of odmlq).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from odmlq import litert, xla
from odmlq.constraints import Target
from odmlq.errors import PlanError
from odmlq.plan import Plan
from odmlq.plan import plan as plan_for_targets

__all__ = ["TARGETS", "plan", "ptq", "targets_of"]

TARGETS: dict[str, tuple[Target, ...]] = {
    "litert": (litert.TARGET,),
    "xla": (xla.TARGET,),
    "both": (xla.TARGET, litert.TARGET),
}


def targets_of(target: str | Target | Sequence[Target]) -> tuple[Target, ...]:
    """The targets a name stands for ('litert', 'xla', 'both'), or the targets given.

    Raises:
      PlanError: an unknown name (the valid ones are listed).
    """
    if isinstance(target, str):
        if target not in TARGETS:
            raise PlanError(f"target={target!r} is not a target; choose one of {sorted(TARGETS)}.")
        return TARGETS[target]
    return (target,) if isinstance(target, Target) else tuple(target)


def plan(model: Any, rules, *example_inputs: Any, variables: Any = None, method: Any = None,
         target: str | Target | Sequence[Target] = "both", state: Mapping[int, int] | None = None) -> Plan:
    """`odmlq.plan.plan` for targets given by name: 'both' (default: `ptq` and
    `export_tflite` compute the same scales), 'litert', or 'xla' (every scale
    calibrated; such a plan is refused by the LiteRT export).

    Example:
      >>> p = odmlq.plan(model, [odmlq.Rule('.*', weight_qtype='int8', act_qtype='int8')], x)
      >>> print(p)
    """
    return plan_for_targets(model, rules, *example_inputs, variables=variables, method=method,
                            target=targets_of(target), state=state)


def ptq(model: Any, rules, params: Any = None, calibration=None, *,
        example_inputs: Sequence[Any] | None = None,
        target: str | Target | Sequence[Target] = "both", method: Any = None,
        state: Mapping[int, int] | None = None) -> xla.QuantizedModel:
    """`odmlq.xla.ptq`, planning for `target` ('both' by default) when given rules.

    With the default, the quantized model computes what the LiteRT export of
    the same rules and calibration computes, edge for edge. See
    `odmlq.xla.ptq` for the arguments.

    Example:
      >>> qmodel = odmlq.ptq(model, rules, variables, calibration, example_inputs=(x,))
      >>> y = qmodel(x)
    """
    return xla.ptq(model, rules, params, calibration, example_inputs=example_inputs,
                   target=targets_of(target), method=method, state=state)
