"""How fast a configuration runs on its backend, against float (internal).

A latency budget is measured, never predicted: LiteRT's speed turns on which
ops XNNPACK takes (a quantized op it has no kernel for runs on LiteRT's
reference kernels and splits the graph into more partitions), XLA's on the
kernels it compiles. Each configuration autotune measures is timed with its
float twin in the same interleaved rounds, so the ratio holds on a busy
machine:

- LiteRT: the configuration's .tflite (batch 1, one thread, XNNPACK) against
  the float model's .tflite, on the first sample of the evaluation data;
- XLA: the jitted `odmlq.ptq` model against the same path with no rules, on
  the first evaluation batch.

`off_delegate_by_candidate` and `off_delegate` name the groups whose
quantized ops XNNPACK does not run, for autotune's latency-gated placement.
"""

from __future__ import annotations

import warnings

import numpy as np

from odmlq.report.tune._converts import Converts
from odmlq.timing import interleaved_ms
from odmlq.report.tune._model import BACKENDS, TunedModel, rules_for

__all__ = ["Timer"]

_ROUNDS = 7
_ROUND_MS = 20.0  # each model runs this long per round, at least


class Timer:
    """`timer(config) -> (ms, float_ms)`: median milliseconds per run of the
    configuration and of the float model, timed in the same rounds."""

    def __init__(self, tuned: TunedModel, converts: Converts):
        self.tuned, self.converts = tuned, converts
        self._float = None

    def __call__(self, config: np.ndarray) -> tuple[float, float]:
        if self.tuned.backend == "xla":
            return self._xla(config)
        return self._litert(config)

    def off_delegate(self, config: np.ndarray) -> list[int]:
        """Groups at a quantized candidate with an op that XNNPACK leaves to
        LiteRT's reference kernels in the configuration's export."""
        export = self.converts.export_of(config)
        return sorted(g for g in _groups_outside(export, self.tuned.op_group)
                      if not self.tuned.candidates[config[g]].is_float)

    def off_delegate_by_candidate(self) -> np.ndarray:
        """(candidates, groups) bool: whether XNNPACK leaves one of the
        group's ops to the reference kernels with the whole model at the
        candidate (one unverified export per quantized candidate; a candidate
        the converter refuses whole is left to `off_delegate`)."""
        from odmlq.errors import OdmlqError
        from odmlq.litert import export_tflite

        tuned = self.tuned
        off = np.zeros((len(tuned.candidates), len(tuned.groups)), bool)
        for c, (candidate, plan) in enumerate(zip(tuned.candidates, tuned.plans)):
            if candidate.is_float:
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    export = export_tflite(tuned.model, plan, tuned.batches, variables=tuned.variables,
                                           calibration=tuned.calibration_for(plan), verify=False,
                                           allow_float_ops=True, benchmark=False, progress=False)
            except OdmlqError:
                continue
            off[c, sorted(_groups_outside(export, tuned.op_group))] = True
        return off

    def _litert(self, config) -> tuple[float, float]:
        from odmlq.litert import export_tflite, interleaved_latency

        tuned = self.tuned
        if self._float is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._float = export_tflite(tuned.model, [], tuned.batches, variables=tuned.variables,
                                            verify=False, progress=False).tflite
        quantized = self.converts.export_of(config).tflite
        sample = [np.asarray(x)[:1] for x in tuned.eval_batches[0]]
        # (Each file is invoked for 20 ms a round, `_ROUND_MS`: interleaved_latency's default.)
        float_ms, ms = interleaved_latency([self._float, quantized], sample, rounds=_ROUNDS)
        return ms, float_ms

    def _xla(self, config) -> tuple[float, float]:
        from odmlq import xla

        tuned = self.tuned
        batch = tuned.eval_batches[0]
        rules = rules_for(tuned, config)
        target = BACKENDS[tuned.backend]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if self._float is None:
                self._float = xla.ptq(tuned.model, [], tuned.params, None, example_inputs=batch, target=target)
            quantized = xla.ptq(tuned.model, rules, tuned.params, tuned.calibration_for(tuned.base.replan(rules)),
                                example_inputs=batch, target=target)
        float_ms, ms = interleaved_ms([lambda: self._float(*batch), lambda: quantized(*batch)], rounds=_ROUNDS,
                                      round_ms=_ROUND_MS)
        return ms, float_ms


def _groups_outside(export, op_group: dict[str, int]) -> set[int]:
    groups = {_group_of(op.module_path, op_group) for op in export.delegation.outside}
    return groups - {None}


def _group_of(module_path: str | None, op_group: dict[str, int]) -> int | None:
    """The group of the graph op a LiteRT op's module path names: the op id
    itself, or the nearest enclosing one (a conversion named `<edge>/to_int8`)."""
    path = module_path
    while path:
        if path in op_group:
            return op_group[path]
        path = path.rpartition("/")[0]
    return None
