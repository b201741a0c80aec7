"""What each group of ops costs the outputs at each candidate precision (internal).

For one candidate, the whole model is planned at it and its scales computed
once; one jitted run then takes a mask with an entry per group, and every
quantization the plan places (edges, weights and biases, constants, converted
and dynamic inputs, folded biases) is taken or left by the mask entry of the
group of the op that owns it. With a one-hot mask the run is the model
with only that group quantized: its output error, per output and per sample,
is the group's noise at that candidate. Output noise from several groups adds
up to first order (independent rounding), which is what `_search` predicts
with; every configuration it proposes is then measured for real.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from odmlq.graph import GraphCache, flat_params, fold_params, replace_params
from odmlq.hooks import FakeQuant, PlanHooks, dynamic_fake_quant
from odmlq.scales import Scales, fake_quant_bias, folded_weights, quantized_params

__all__ = ["edge_groups", "energies", "group_noise", "output_errors"]


class _Blend(FakeQuant):
    """`FakeQuant`, each quantization scaled by its group's mask entry."""

    def integer_sums(self, op) -> bool:
        return False  # a blend of float and quantized values is on no grid

    def __init__(self, mask: jax.Array, edge_group: Mapping[str, int], op_group: Mapping[str, int]):
        self.mask, self.edge_group, self.op_group = mask, edge_group, op_group

    def _mix(self, group: int | None, x, q):
        # A select, not x + m (q - x): a float value of inf (a -inf mask
        # constant) would make the unselected side NaN.
        return q if group is None else jnp.where(self.mask[group] > 0, q, x)

    def edge(self, edge_id, x, ts):
        return self._mix(self.edge_group.get(edge_id), x, ts.fake_quant(x))

    def constant(self, op, index, value, ts):
        x = jnp.asarray(value, jnp.float32)
        return self._mix(self.op_group.get(op.id), x, ts.fake_quant(x))

    def converted_input(self, op, index, x, ts):
        return self._mix(self.op_group.get(op.id), x, ts.fake_quant(x))

    def dynamic_input(self, op, index, x, spec):
        return self._mix(self.op_group.get(op.id), x, dynamic_fake_quant(x, spec))

    def folded_bias(self, op, bias, scale):
        return bias if scale is None else self._mix(self.op_group.get(op.id), bias, fake_quant_bias(bias, scale))


def edge_groups(graph, op_group: Mapping[str, int]) -> dict[str, int]:
    """Edge id -> the group of the op whose rule decides it (its producer; a
    model input's first consumer)."""
    out = {}
    for edge_id, edge in graph.edges.items():
        owner = edge.producer if edge.producer is not None else (edge.consumers[0] if edge.consumers else None)
        if owner is not None and owner in op_group:
            out[edge_id] = op_group[owner]
    return out


def energies(outputs: Sequence[np.ndarray]) -> np.ndarray:
    """Energy per output and per sample (axis 0 of each output): (outputs, samples)."""
    return np.stack([np.sum(np.reshape(np.asarray(o, np.float64) ** 2, (np.shape(o)[0], -1)), axis=1)
                     for o in outputs])


def output_errors(outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> np.ndarray:
    """Error energy per output and per sample (axis 0 of each output): (outputs, samples)."""
    return energies([np.asarray(o, np.float64) - np.asarray(r, np.float64) for o, r in zip(outputs, reference)])


def group_noise(model: Any, plan, scales: Scales, params: Any, batches: Sequence[tuple],
                reference: Sequence[Sequence[np.ndarray]], op_group: Mapping[str, int], groups: int, *,
                variables: Any = None, only: Sequence[int] | None = None,
                on_group: Callable[[], None] | None = None) -> np.ndarray:
    """Output error energy with only each group quantized as `plan` says:
    shape (groups, outputs, samples); groups not in `only` are zero."""
    cache = GraphCache(model, plan, variables)
    float_params = fold_params(plan.graph, params, scales.weights)
    quantized = quantized_params(folded_weights(plan.graph, params, scales), scales)
    flat_float, flat_quantized = flat_params(float_params), flat_params(quantized)
    param_group = {}
    for op in plan.graph.ops:
        for operand in op.operands:
            if operand.param is not None and op.id in op_group:
                param_group.setdefault(operand.param, op_group[op.id])
    paths = [p for p in (*scales.weights, *scales.biases) if p in param_group]
    index = np.array([param_group[p] for p in paths], np.int32)
    lows = [jnp.asarray(flat_float[p], jnp.float32) for p in paths]
    highs = [jnp.asarray(flat_quantized[p], jnp.float32) for p in paths]
    edge_group = edge_groups(plan.graph, op_group)
    runs: dict[int, Callable] = {}

    def runner(graph):
        def run(mask, lows, highs, *xs):
            blended = {p: jnp.where(mask[i] > 0, hi, lo) for p, i, lo, hi in zip(paths, index, lows, highs)}
            tree = replace_params(float_params, blended)
            hooks = PlanHooks(plan, scales, _Blend(mask, edge_group, op_group))
            return jax.tree_util.tree_leaves(hooks.evaluate(graph, tree, *xs))
        return jax.jit(run)

    energy = np.zeros((groups, len(reference[0]), sum(np.shape(r[0])[0] for r in reference)))
    for g in (range(groups) if only is None else only):
        mask = jnp.zeros(groups, jnp.float32).at[g].set(1.0)
        start = 0
        for batch, ref in zip(batches, reference):
            graph = cache.graph_for(batch)
            if id(graph) not in runs:
                runs[id(graph)] = runner(graph)
            run = runs[id(graph)]
            errors = output_errors([np.asarray(o) for o in run(mask, lows, highs, *batch)], ref)
            energy[g, :, start:start + errors.shape[1]] = errors
            start += errors.shape[1]
        if on_group is not None:
            on_group()
    return energy
