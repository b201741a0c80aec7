"""The chosen rules run by the backends themselves, against float (internal)."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np

from odmlq.errors import OdmlqError
from odmlq.rules import Rule
from odmlq.report.tune._model import BACKENDS, TunedModel
from odmlq.report.tune._sensitivity import energies, output_errors
from odmlq.report.tune._target import accuracy_of

__all__ = ["check_rules"]


def check_rules(tuned: TunedModel, rules: list[Rule], config, say) -> dict[str, Any]:
    """The rules run by the backend(s) themselves, against float."""
    checks: dict[str, Any] = {}
    calibration_plan = tuned.base.replan(rules)
    calibration = tuned.calibration_for(calibration_plan)
    float_islands = any(tuned.candidates[c].is_float for c in config)
    batch = tuned.eval_batches[0]
    reference = tuned.reference[0]
    if tuned.backend in ("litert", "both"):
        from odmlq.litert import export_tflite

        say("exporting and verifying the chosen rules on LiteRT")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = export_tflite(tuned.model, rules, tuned.batches, variables=tuned.variables,
                                       calibration=calibration, allow_float_ops=float_islands, benchmark=False,
                                       progress=False)
            checks["litert"] = (f"exported {len(result.tflite)} bytes, "
                                + ("verified op by op" if result.verification is not None
                                   and result.verification.passed else "not verified"))
        except OdmlqError as error:
            checks["litert"] = f"FAILED: {error}"
    if tuned.backend in ("xla", "both"):
        from odmlq import xla

        say("quantizing and running the chosen rules on XLA")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                qmodel = xla.ptq(tuned.model, rules, tuned.params, calibration, example_inputs=batch,
                                 target=BACKENDS[tuned.backend])
            outputs = [np.asarray(o) for o in jax.tree_util.tree_leaves(qmodel(*batch))]
            sqnr, _ = accuracy_of(output_errors(outputs, reference), energies(reference))
            checks["xla"] = f"ran quantized, output SQNR {sqnr:.2f} dB on the first evaluation batch"
        except OdmlqError as error:
            checks["xla"] = f"FAILED: {error}"
    return checks
