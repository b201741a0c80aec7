"""Weights `nn.scan` stacks along a layer axis, annotated one layer at a time
(internal; `_annotate.annotated_function`).

A stacked kernel's plan scales are per layer and per output channel (two
scale axes), which no LiteRT tensor holds. The export unrolls the loop
(`graph._program._run_scan` reads step i's slice as ``x[i]``), so each layer's
slice becomes a tensor of its own, annotated with its layer's scales: what
`simulate` computes, since slicing a fake-quantized stack is the same as
fake-quantizing each slice with its own scales.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from odmlq.scales import TensorScale

__all__ = ["Layers", "annotated_layers", "carry_starts", "layer_scale", "stacked_weights"]


def stacked_weights(plan) -> frozenset[str]:
    """Quantized parameters a loop reads one layer per step, stacked along the
    parameter's first axis (the loop's)."""
    stacked = {o.param for op in plan.graph.ops for o in op.operands
               if o.param is not None and o.stacked_axes == (0,)}
    return frozenset(p for p in stacked if any(w.param == p and w.spec is not None
                                                for o in plan.ops.values() for w in o.weights))


def layer_scale(ts: TensorScale, layer: int) -> TensorScale:
    """Layer `layer`'s scales of a weight stacked along axis 0."""
    def take(a):
        a = np.asarray(a)
        return a[layer] if a.ndim and a.shape[0] > 1 else a.reshape(a.shape[1:]) if a.ndim else a

    return dataclasses.replace(ts, scale=take(ts.scale),
                               zero_point=None if ts.zero_point is None else take(ts.zero_point),
                               scale_axes=tuple(a - 1 for a in ts.scale_axes if a != 0))


class Layers:
    """A stacked weight as the unrolled loop reads it: ``layers[i]`` is layer
    i's tensor, annotated on its own. It is no array: a model that reads the
    stack otherwise than one layer per step is refused before conversion
    (`_check.check_plan`)."""

    def __init__(self, parts: Sequence):
        self.parts = list(parts)

    def __getitem__(self, layer: int):
        return self.parts[layer]


def annotated_layers(value: np.ndarray, ts: TensorScale, annotate: Callable) -> Layers:
    """``annotate(layer value, layer scale)`` for each layer of `value`."""
    return Layers([annotate(np.asarray(value[i]), layer_scale(ts, i)) for i in range(np.shape(value)[0])])


def carry_starts(graph, scales) -> dict[str, TensorScale]:
    """Carry edge -> the grid of the value its loop starts it from, where that
    is another grid: the first step requantizes the start onto the carry's,
    and litert-converter would fold that QUANTIZE into the op computing the
    start (which then writes the carry's scale, not its own). Read after a
    same-scale MAXIMUM (`_forms.separated`), it stays a QUANTIZE."""
    out: dict[str, TensorScale] = {}
    for loop in (op for op in graph.ops if op.kind == "scan"):
        for carry, start, _ in loop.attributes.get("carries", ()):
            source = scales.edges.get(graph.resolve(start)) if start is not None else None
            if source is not None and not source.scale_axes and not source.same_grid(scales.edges.get(carry)):
                out[carry] = source
    return out
