"""Trying suggested rules: re-plan, re-use the calibration, measure (internal).

For each `Advice`, the rule is put first in the plan's rules and the traced
graph is planned again (no re-tracing). Scales come from the same calibration
statistics; an edge is observed again from the representative data only
when the statistics cannot give its new range: an edge the calibration
lacks, or an edge of the suggested rule whose method changed to one its
statistics do not support (a histogram method on min/max statistics, any
method on a `FixedRange` entry, which holds no data). The output SQNR against
float is measured with `simulate` on the report's inputs, against the same
measure without the rule; with a .tflite, the plan is exported again
(`odmlq.export_tflite`) for its size and its outputs in LiteRT.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np

from odmlq.progress import steps
from odmlq.report._advice import Advice, Measured
from odmlq.report._metrics import edge_metrics
from odmlq.batches import leaves
from odmlq.report._runs import litert_run
from odmlq.calibration import Calibration, derivable
from odmlq.errors import CalibrationError, OdmlqError
from odmlq.rules import UnmatchedRuleWarning


def output_sqnr(reference: list[np.ndarray], outputs: list[np.ndarray]) -> float:
    """The lowest SQNR (dB) of `outputs` against `reference`, output by output."""
    return min((edge_metrics(r, o).sqnr_db for r, o in zip(reference, outputs)), default=float("inf"))


@dataclasses.dataclass(kw_only=True)
class FixTrials:
    """Everything a suggestion is measured with: the compared model and its data."""

    model: Any
    variables: Any
    plan: Any
    calibration: Calibration
    rep_dataset: list | None
    inputs: tuple
    float_outputs: list[np.ndarray]
    tflite: bytes | None
    allow_float_ops: bool = False  # the compared .tflite has float ops already

    def __post_init__(self):
        self._baseline = self._simulated(self.plan, self.calibration)

    def measure(self, advice: Advice) -> Advice:
        """`advice` with what its rule measures.

        Raises:
          OdmlqError: the plan or calibration it needs cannot be made (for
            instance, an edge must be observed again and there is no rep_dataset).
        """
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnmatchedRuleWarning)
            plan = self.plan.replan((advice.rule, *self.plan.rules))
        calibration = self._calibration_for(plan)
        sqnr = self._simulated(plan, calibration)
        measured = Measured(output_sqnr_db=sqnr, gain_db=sqnr - self._baseline)
        if self.tflite is not None:
            size, litert_sqnr = self._exported(plan, calibration, allow_float_ops=advice.rule.skip or self.allow_float_ops)
            measured = dataclasses.replace(measured, size_bytes=size, size_delta_bytes=size - len(self.tflite),
                                           litert_output_sqnr_db=litert_sqnr)
        return dataclasses.replace(advice, measured=measured)

    def _simulated(self, plan, calibration) -> float:
        from odmlq.graph import params_for
        from odmlq.scales import compute_scales
        from odmlq.simulate import Simulator

        params = params_for(self.model, self.variables, "compare")
        scales = compute_scales(plan, calibration, params)
        outputs = Simulator(self.model, plan, scales, variables=self.variables)(*self.inputs)
        return output_sqnr(self.float_outputs, leaves(outputs))

    def _calibration_for(self, plan) -> Calibration:
        entries = dict(self.calibration)
        need = []
        for edge_id, edge_plan in plan.edges.items():
            spec = edge_plan.spec
            if spec is None or spec.dynamic or plan.graph.edges[edge_id].alias is not None:
                continue
            if edge_id not in entries:
                need.append(edge_id)
                continue
            method, stats = entries[edge_id]
            if edge_plan.rule != 0 or method == spec.calibration:
                continue  # not the suggested rule's edge: the statistics as given
            if derivable(method, stats, spec.calibration, spec.scale_axes):
                entries[edge_id] = (spec.calibration, stats)
            else:
                need.append(edge_id)
        if need:
            if self.rep_dataset is None:
                raise CalibrationError(
                    f"Measuring this rule needs new statistics for edge(s) {need}; pass "
                    "rep_dataset=... (the representative batches) to compare().")
            from odmlq.calibration import calibrate

            only = {e: p if e in need else dataclasses.replace(p, spec=None) for e, p in plan.edges.items()}
            fresh = calibrate(self.model, dataclasses.replace(plan, edges=only), self.rep_dataset,
                              variables=self.variables, progress=False)
            entries.update(dict(fresh))
        return Calibration(entries)

    def _exported(self, plan, calibration, *, allow_float_ops: bool) -> tuple[int, float]:
        from odmlq.litert.export import export_tflite

        from odmlq.litert.verify import preserving_interpreter

        details = preserving_interpreter(self.tflite).get_input_details()
        examples = tuple(np.zeros(d["shape"], self.plan.graph.edges[e].dtype)
                         for d, e in zip(details, self.plan.graph.inputs))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = export_tflite(self.model, plan, None, variables=self.variables, example_inputs=examples,
                                   calibration=calibration, verify=False, allow_float_ops=allow_float_ops,
                                   benchmark=False)
        run = litert_run(result.tflite, plan, result.scales, self.inputs)
        return len(result.tflite), output_sqnr(self.float_outputs, run.outputs)


def measure_all(trials: FixTrials, advice: list[Advice], progress: bool | None = None
                ) -> tuple[list[Advice], list[str]]:
    """Every suggestion measured; one that cannot be is kept unmeasured, with a note why."""
    out, notes = [], []
    for a in steps(advice, "trying fixes", progress=progress, unit="fix"):
        try:
            out.append(trials.measure(a))
        except OdmlqError as error:
            out.append(a)
            notes.append(f"advice for {a.edge!r}: {a.change} not measured: {error}")
    return out, notes
