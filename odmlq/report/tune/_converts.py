"""Whether litert-converter takes a configuration, and which group it refuses (internal).

`litert.check_plan` knows the converter's limits that have been measured;
the converter can still refuse a plan it passes (a failed verifier in one of
its passes, with no op named). Autotune converts each configuration it is
about to measure; where the converter refuses it, a bisection over the
quantized groups finds one that the refusal needs: with the groups after it
in float the model converts, with it quantized too it does not. That
group's candidate is then not offered to it again.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np

from odmlq.errors import OdmlqError

__all__ = ["Converts", "refused_group"]


class Converts:
    """`converts(config)`: whether the converter takes the configuration's
    rules, exported as `odmlq.export_tflite` exports them (cached)."""

    def __init__(self, tuned):
        self.tuned = tuned
        self._seen: dict[bytes, bool] = {}
        self._last: tuple[bytes, object] | None = None  # the last configuration converted, its Export

    def __call__(self, config: np.ndarray) -> bool:
        key = config.tobytes()
        if key not in self._seen:
            from odmlq.litert import ConversionError

            try:
                self._export(config)
                self._seen[key] = True
            except ConversionError:
                self._seen[key] = False
        return self._seen[key]

    def export_of(self, config: np.ndarray):
        """The configuration's unverified `Export` (batch 1), converted again
        unless it was the last one converted."""
        if self._last is not None and self._last[0] == config.tobytes():
            return self._last[1]
        return self._export(config)

    def _export(self, config: np.ndarray):
        from odmlq.litert import export_tflite
        from odmlq.report.tune._model import rules_for

        tuned = self.tuned
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rules = rules_for(tuned, config)
            export = export_tflite(tuned.model, rules, tuned.batches, variables=tuned.variables,
                                   calibration=tuned.calibration_for(tuned.base.replan(rules)), verify=False,
                                   allow_float_ops=True, benchmark=False, progress=False)
        self._last = (config.tobytes(), export)
        return export


def refused_group(config: np.ndarray, floats: int, plan_of: Callable[[np.ndarray], object],
                  converts: Converts) -> int:
    """A group the converter's refusal of `config` needs (the model converts
    with it and every later quantized group in float, and not with it
    quantized too), found by bisection over the quantized groups in op order.

    `floats` is the float candidate's index; `plan_of(config)` raises
    `OdmlqError` where the configuration's plan itself is refused (counted as
    not converting).
    """
    suspects = [g for g in range(len(config)) if config[g] != floats]
    if not suspects:
        raise OdmlqError("autotune: litert-converter refuses the model with every group in float; "
                         "export it with odmlq.export_tflite(model, [], ...) to see the converter's error.")

    def with_prefix(k: int) -> bool:
        trial = config.copy()
        trial[suspects[k:]] = floats
        try:
            plan_of(trial)
            return converts(trial)
        except OdmlqError:
            return False

    low, high = 0, len(suspects)  # the first `low` suspects convert; the first `high` do not
    while high - low > 1:
        middle = (low + high) // 2
        if with_prefix(middle):
            low = middle
        else:
            high = middle
    return suspects[high - 1]
