"""The runs a report lines up, each captured by plan edge id (internal).

- float: the traced graph evaluated as it is;
- simulate / local: `Simulator` with and without float inputs fed to each op;
- xla: a `QuantizedModel` (odmlq.ptq) with ``capture=True``;
- litert: the LiteRT interpreter with every tensor kept, tensors mapped to
  edges by name as verification maps them (`odmlq.litert.verify.map_tensors`);
- device: a dump of the same .tflite's tensors made on a device
  (`samples/dump_tensors.py`), mapped like litert.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from odmlq.batches import leaves
from odmlq.errors import OdmlqError, PlanError
from odmlq.graph import loop_edges, shift_output
from odmlq.litert.device import NOT_ODMLQ
from odmlq.report._metrics import EdgeMetrics, edge_metrics


def float_run(graph, params, inputs: tuple, shifts=None) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    """Outputs and every edge of the model in float. With `shifts`
    (`Scales.shifts`), the ops of balanced sums shift their outputs as the
    quantized model does: the same outputs, and each edge lines up with its
    quantized value."""
    captured: dict[str, Any] = {}
    shifts = shifts or {}

    def on_op(op_id, compute, *operands):
        outputs = compute(*operands)
        if op_id not in shifts:
            return outputs
        return [shift_output(graph.op(op_id), outputs[0], shifts[op_id]), *outputs[1:]]

    in_loops = loop_edges(graph)

    def keep(edge_id, x):
        # The value itself goes on: a loop's body edge passes here at every step,
        # kept as the steps' stack (as `odmlq.hooks.PlanHooks` captures it).
        if edge_id in in_loops:
            captured.setdefault(edge_id, []).append(x)
        else:
            captured[edge_id] = x
        return x

    out = graph.evaluate(params, *inputs, on_edge=keep, on_op=on_op)
    return leaves(out), {k: np.stack(v) if isinstance(v, list) else np.asarray(v) for k, v in captured.items()}


def check_xla(qmodel, plan) -> None:
    """Raises PlanError when `qmodel` is not a QuantizedModel of a plan with `plan`'s ops."""
    from odmlq.xla.ptq import QuantizedModel

    if not isinstance(qmodel, QuantizedModel):
        raise PlanError(f"compare(xla=...) takes a QuantizedModel (odmlq.ptq(model, plan, ...)), "
                        f"not a {type(qmodel).__name__}.")
    theirs = [o.id for o in qmodel.plan.graph.ops]
    if theirs != [o.id for o in plan.graph.ops]:
        raise PlanError(
            "compare(xla=...): the QuantizedModel was made from a plan with other ops "
            f"({len(theirs)} ops, e.g. {theirs[:3]}) than the one compared; pass "
            "odmlq.ptq(model, plan, ...) of this plan.")


def xla_run(qmodel, inputs: tuple) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    """Outputs and every edge as the XLA backend computes them."""
    out, captured = qmodel(*inputs, capture=True)
    return leaves(out), {k: np.asarray(v) for k, v in captured.items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LiteRTRun:
    """LiteRT's (host) and optionally a device's tensors, per edge and output."""

    edges: dict[str, np.ndarray]
    outputs: list[np.ndarray]
    unmapped: tuple[str, ...]
    mismatched_scales: tuple[str, ...] = ()
    device_edges: dict[str, np.ndarray] | None = None
    device_outputs: list[np.ndarray | None] | None = None  # None: not in the dump
    device_missing: tuple[str, ...] = ()


def check_litert_inputs(interpreter, inputs: Sequence[np.ndarray], names: Sequence[str] | None = None,
                        *, whole: bool = False) -> None:
    """Inputs fit the .tflite: as many as it takes, its shape but for the batch
    (exactly its shape with `whole`: one invocation).

    Raises:
      OdmlqError: naming the input, its shape and the shape the model takes.
    """
    details = interpreter.get_input_details()
    if len(inputs) != len(details):
        raise OdmlqError(
            f"The .tflite takes {len(details)} input(s) ({', '.join(d['name'] for d in details)}); "
            f"got {len(inputs)}. Give one array per model input, in order.")
    for i, (d, x) in enumerate(zip(details, inputs)):
        want, got = tuple(int(s) for s in d["shape"]), tuple(np.shape(x))
        name = names[i] if names else f"input {i}"
        fits = got == want if whole else (len(got) == len(want) and got[1:] == want[1:]
                                          and got[0] % max(want[0], 1) == 0)
        if not fits:
            batch = "" if whole else f" (or a multiple of its batch size {want[0]})"
            raise OdmlqError(
                f"Input {name!r} has shape {got}, but the .tflite's input {d['name']!r} takes "
                f"{want}{batch}; give inputs of that shape.")


def litert_run(tflite: bytes, plan, scales, inputs: tuple,
               device: Mapping[str, np.ndarray] | None = None, whole: Any = None) -> LiteRTRun:
    """LiteRT's dequantized tensors per edge and its outputs, the batch stitched
    back together (along each edge's batch axis where `whole`, the graph
    traced at the inputs' batch, shows it; else along axis 0); with `device`,
    the dump's tensors likewise (one invocation).

    Raises:
      OdmlqError: inputs that do not fit the model; a dumped tensor of another shape.
    """
    from odmlq.litert.verify import (dequantize_tensor, from_output, output_details, params_match, sample_rows, to_input, map_tensors,
                                     preserving_interpreter, produced_tensors)

    interpreter = preserving_interpreter(tflite)
    check_litert_inputs(interpreter, leaves(inputs), whole=device is not None)
    details = {d["index"]: d for d in interpreter.get_tensor_details()}
    produced = set(produced_tensors(interpreter))
    mapping = map_tensors(list(details.values()), produced, plan, scales, ops=interpreter._get_ops_details())
    outputs_detail = output_details(interpreter)
    values: dict[str, list] = {e: [] for e in mapping}
    outs: list[list] = [[] for _ in outputs_detail]
    for row in sample_rows([tuple(inputs)], interpreter):
        for d, x in zip(interpreter.get_input_details(), leaves(row)):
            interpreter.set_tensor(d["index"], to_input(x, d))
        interpreter.invoke()
        for e, i in mapping.items():
            values[e].append(dequantize_tensor(interpreter.get_tensor(i), details[i]))
        for k, d in enumerate(outputs_detail):
            outs[k].append(from_output(interpreter.get_tensor(d["index"]), d))
    unmapped = tuple(details[i]["name"] for i in sorted(produced)
                     if i not in mapping.values() and details[i]["dtype"] in (np.int8, np.int16))
    mismatched = tuple(e for e, i in mapping.items() if not params_match(details[i], scales.edges[e]))
    run = LiteRTRun(edges={e: _stitched(v, whole.edges[e].shape if whole is not None and e in whole.edges else None)
                           for e, v in values.items() if v},
                    outputs=[np.concatenate(o) for o in outs], unmapped=unmapped,
                    mismatched_scales=mismatched)
    if device is None:
        return run
    device_edges, missing = {}, []
    for e, i in mapping.items():
        got = _dumped(device, details[i], run.edges[e].shape)
        if got is None:
            missing.append(details[i]["name"])
        else:
            device_edges[e] = dequantize_tensor(got, details[i])
    device_outputs = []
    for d, host in zip(outputs_detail, run.outputs):
        got = _dumped(device, details[d["index"]], host.shape)
        if got is None:
            missing.append(d["name"])
        device_outputs.append(None if got is None else from_output(got, d))
    return dataclasses.replace(run, device_edges=device_edges, device_outputs=device_outputs,
                               device_missing=tuple(dict.fromkeys(missing)))


def _stitched(parts: list, shape: tuple | None) -> np.ndarray:
    """One edge's values from each invocation, joined along its batch axis: the
    axis on which `shape` (the edge at the whole batch) is the parts' sum, as
    where an einsum puts its kernel's axes first (``'BTD,CKDH->CBTKH'``); axis 0
    where `shape` says nothing."""
    part = np.shape(parts[0])
    if shape is not None and len(shape) == len(part):
        for axis in range(len(part)):
            if shape[axis] == part[axis] * len(parts) and all(
                    shape[a] == part[a] for a in range(len(part)) if a != axis):
                return np.concatenate(parts, axis=axis)
    return np.concatenate(parts)


def _dumped(dump: Mapping[str, np.ndarray], detail: dict, shape: tuple) -> np.ndarray | None:
    """The dumped value of one tensor (by name, or ``t<index>``), or None if absent."""
    key = detail["name"] if detail["name"] in dump else f"t{detail['index']}"
    if key not in dump:
        return None
    got = np.asarray(dump[key])
    if got.shape != tuple(shape):
        raise OdmlqError(f"Tensor {detail['name']!r} is {got.shape} in the device dump but {tuple(shape)} "
                         "in the model; was the dump made from this .tflite on these inputs?")
    return got


def output_metrics(reference: list, values: list, run: str) -> dict[str, EdgeMetrics]:
    """Output metrics of a run, named ``output_<i> (<run>)``; outputs it lacks are left out."""
    return {f"output_{i} ({run})": edge_metrics(r, v) for i, (r, v) in enumerate(zip(reference, values))
            if v is not None and np.shape(v) == np.shape(r)}


def backend_runs(plan, scales, inputs, float_out, xla, tflite, device, whole=None):
    """The xla, litert and device runs: ``(run -> (edge values, their scales),
    output metrics, LiteRT tensors with no edge, notes)``; `whole`: the graph
    at the inputs' batch (`litert_run`)."""
    backends: dict[str, tuple[dict, Any]] = {}
    outputs: dict[str, EdgeMetrics] = {}
    notes: list[str] = []
    unmapped: tuple[str, ...] = ()
    if xla is not None:
        xla_out, xla_edges = xla_run(xla, inputs)
        backends["xla"] = (xla_edges, xla.scales)
        outputs.update(output_metrics(float_out, xla_out, "xla"))
    if tflite is None:
        return backends, outputs, unmapped, notes
    run = litert_run(tflite, plan, scales, inputs, device, whole)
    if run.edges or not any(e in scales.edges for e in plan.edges):
        backends["litert"] = (run.edges, scales)
        if run.device_edges is not None:
            backends["device"] = (run.device_edges, scales)
        unmapped = run.unmapped
    else:
        notes.append(f"{NOT_ODMLQ} (no tensor of the .tflite maps to an edge of this plan)")
    outputs.update(output_metrics(float_out, run.outputs, "litert"))
    if run.device_outputs is not None:
        outputs.update(output_metrics(float_out, run.device_outputs, "device"))
    if run.mismatched_scales:
        notes.append(f"{len(run.mismatched_scales)} LiteRT tensor(s) have other scales than the plan's "
                     f"(e.g. {run.mismatched_scales[0]!r}): was the .tflite exported with these scales?")
    if run.device_missing:
        notes.append(f"missing from the device dump ({len(run.device_missing)}): " + ", ".join(run.device_missing))
    return backends, outputs, unmapped, notes
