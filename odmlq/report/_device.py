"""A device run as a `Report` (for JSON and HTML): with the model (and for an
odmlq model, its plan and scales), every edge against float, simulate and the
host interpreter; otherwise the outputs only."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from odmlq.graph import params_for, trace
from odmlq.litert.device import NOT_ODMLQ, DeviceDiff, dump_tensors, output_value
from odmlq.litert.verify import output_details, preserving_interpreter
from odmlq.report._report import Report, compare
from odmlq.batches import leaves
from odmlq.report._runs import output_metrics

__all__ = ["device_report"]


def device_report(tflite: bytes, inputs: Mapping[str, np.ndarray], dump: Mapping[str, np.ndarray],
                  diff: DeviceDiff, *, model: Any = None, variables: Any = None, plan=None,
                  scales=None) -> Report:
    """A `Report` of a device run: every edge when the model, its plan and scales
    are given and the .tflite is odmlq's; otherwise its outputs only.

    Args:
      tflite, inputs, dump: as `diff_device`.
      diff: `diff_device`'s result (its findings become notes).
      model, variables: the float model, for a float reference.
      plan, scales: the plan and scales the .tflite was exported with.
    """
    arrays = tuple(np.asarray(x) for x in inputs.values())
    notes = [f"device vs host interpreter: {line}" for line in diff.summary()]
    if model is not None and plan is not None and not diff.outputs_only:
        report = compare(model, plan, scales, *arrays, variables=variables, tflite=tflite, device=dump)
        return dataclasses.replace(report, notes=(*report.notes, *notes))
    interpreter = preserving_interpreter(tflite)
    host = dump_tensors(tflite, dict(inputs))
    out_details = output_details(interpreter)
    host_out = [output_value(host[d["name"]], d) for d in out_details]
    keys = [d["name"] if d["name"] in dump else f"t{d['index']}" for d in out_details]
    device_out = [output_value(np.asarray(dump[k]), d) if k in dump else None for k, d in zip(keys, out_details)]
    notes = ([NOT_ODMLQ] if diff.outputs_only else []) + notes
    if model is None:
        outputs = output_metrics(host_out, device_out, "device")
        notes.insert(0, "no model given: the device's outputs are compared with the host "
                        "interpreter's (no float reference)")
        return Report(edges=(), outputs=outputs, notes=tuple(notes), run_names=("device",))
    reference = _float_outputs(model, variables, arrays)
    outputs = {**output_metrics(reference, host_out, "litert"), **output_metrics(reference, device_out, "device")}
    if not diff.outputs_only:
        notes.insert(0, "no plan given: outputs only")
    return Report(edges=(), outputs=outputs, notes=tuple(notes), run_names=("litert", "device"))


def _float_outputs(model: Any, variables: Any, arrays: tuple) -> list[np.ndarray]:
    """The float model's outputs on `arrays`."""
    graph = trace(model, *arrays, variables=variables)
    return leaves(graph.evaluate(params_for(model, variables, "odmlq diff"), *arrays))
