"""Edges that repeat an earlier edge's computation (internal; `repeated_edges`).

A model may compute one value twice: every ResNet block of diffusers' Flax
UNet applies ``nn.swish`` to the same time embedding, and an attention layer
may rebuild the same mask bias from the same mask. The traced graph keeps
both ops; litert-converter's common-subexpression pass keeps one tensor, so
the second edge has no tensor of its own in the .tflite, and the ops that
read it there read the first one's.
"""

from __future__ import annotations

import numpy as np

from odmlq.graph._program import _Lit, _Step

__all__ = ["repeated_edges"]


def repeated_edges(graph) -> dict[str, str]:
    """``{edge: the earlier edge it repeats}``.

    An op repeats an earlier one when its primitives, their parameters and
    its pattern's attributes are the same and it reads the same operands: the
    same edges (or edges that repeat them), model parameters and literals.
    Its output edges then hold the earlier op's values. An op whose
    parameters print an object's address (a function), that runs a loop or
    that a loop runs, repeats nothing: its equality cannot be read off the
    program.
    """
    body = getattr(getattr(graph, "program", None), "body", None)
    if body is None:
        return {}
    steps_of = {}
    for op_steps in body.op_steps.values():
        steps_of.setdefault(op_steps.op_id, op_steps)
    repeated: dict[str, str] = {}
    first: dict = {}

    for op in graph.ops:
        op_steps = steps_of.get(op.id)
        # An op inside a loop holds another value at every step: it repeats nothing, nor is repeated.
        key = None if op_steps is None or op.region is not None else _key(op, op_steps, body.edge_of, repeated)
        if key is None:
            continue
        earlier = first.setdefault(key, op)
        if earlier is not op and len(earlier.outputs) == len(op.outputs):
            repeated.update({edge: repeated.get(was, was) for edge, was in zip(op.outputs, earlier.outputs)})
    return repeated


def _key(op, op_steps, edge_of: dict, repeated: dict):
    internal: dict[int, tuple[int, int]] = {}
    key = [repr(sorted(op.attributes.items()))]
    for i, step in enumerate(op_steps.steps):
        if not isinstance(step, _Step):
            return None
        params = tuple(sorted((name, repr(value)) for name, value in step.eqn.params.items()))
        if any(" at 0x" in text for _, text in params) or " at 0x" in key[0]:
            return None
        key.append((step.eqn.primitive.name, params,
                    tuple(_operand(v, internal, edge_of, repeated) for v in step.ins)))
        internal.update({v: (i, j) for j, v in enumerate(step.outs)})
    return tuple(key)


def _operand(v, internal: dict, edge_of: dict, repeated: dict) -> tuple:
    if isinstance(v, _Lit):
        value = np.asarray(v.value)
        return ("literal", str(value.dtype), value.shape, value.tobytes())
    if v in internal:
        return ("internal", *internal[v])
    edge = edge_of.get(v)
    if edge is not None:
        return ("edge", repeated.get(edge, edge))
    return ("value", v)  # a model parameter (or a value derived from them): the same variable
