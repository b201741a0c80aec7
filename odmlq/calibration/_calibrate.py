"""calibrate: stream a representative dataset through a planned model."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from odmlq.graph import WeightLayout, GraphCache, check_finite_params, check_inputs, params_for, weight_inputs
from odmlq.calibration._calibration import Calibration, channel_key
from odmlq.calibration._gram import Gram
from odmlq.calibration._methods import MinMax
from odmlq.calibration._parallel import device_parts
from odmlq.calibration._reuse import calibrated_edges
from odmlq.errors import CalibrationError
from odmlq.progress import steps

__all__ = ["calibrate"]

# Rows of one batch a weight's input Gram sums at most (a strided sample of
# the output positions beyond): a convolution over a large image has far more
# patches than its second moment needs, and each costs taps**2 to add.
_MAX_ROWS = 16384


def calibrate(model: Any, plan, rep_dataset: Iterable | Callable[[], Iterable], *,
              variables: Any = None, progress: bool | None = None,
              calibration: Calibration | None = None) -> Calibration:
    """Collects statistics of every statically quantized edge of `plan`, and
    the input second moment (`Gram`) of every weight a weight algorithm rounds
    against the data (`odmlq.GPTQ`).

    Args:
      model: the model the plan was made from (Linen: pass `variables`).
      plan: the Plan; each edge is observed with its spec's calibration method.
      rep_dataset: an iterable of batches, or a callable returning one. A batch
        is an array (one model input) or a tuple of arrays, numpy or jax, of
        the example inputs' shapes and dtypes (any batch size); an input may
        be a pytree of arrays (a dict, as a tokenizer returns). A batch
        whose arrays are split along their first axis over several devices
        (`jax.sharding.NamedSharding`) is calibrated data parallel: each
        device runs its part with the params it holds (replicated, or host
        params placed there once), and the parts are merged as one batch;
        the statistics equal one device's (sums to float rounding).
      progress: show a progress bar on stderr (default: when stderr is a terminal).
      calibration: statistics to add to (merging runs).

    Returns:
      A `Calibration` keyed by edge id; `save()` it to reuse.

    Raises:
      CalibrationError: no batches; a batch with NaN or Inf (names the batch
        index and input); a batch of the wrong shape or dtype; a weight whose
        algorithm needs its inputs, read otherwise than by one matmul or
        convolution (names the op and module).

    Example:
      >>> calibration = odmlq.calibrate(model, plan, [x[i:i + 32] for i in range(0, 320, 32)],
      ...                               variables=variables)
    """
    params = params_for(model, variables, "calibrate")
    check_finite_params(params)
    cache = GraphCache(model, plan, variables)
    edges = calibrated_edges(plan)
    # key -> (edge, method, axes kept): each edge's own statistics, and the
    # per-channel ranges of the operands of sums that balance their offsets.
    observed = {e: (e, spec.calibration, spec.scale_axes) for e, spec in edges.items()}
    for balanced in plan.balanced_sums:
        for edge_id in balanced.edges:
            method = MinMax(headroom=edges[edge_id].calibration.headroom)
            observed[channel_key(edge_id)] = (edge_id, method, (balanced.axis,))
    rounded = {p: spec.algorithm.required for p, spec in plan.weight_specs().items() if spec.algorithm is not None}
    out = Calibration() if calibration is None else calibration
    dataset = rep_dataset() if callable(rep_dataset) else rep_dataset
    collectors: dict[Any, Callable] = {}
    placed: dict = {}  # device -> the params there
    count = 0
    for index, batch in enumerate(steps(dataset, "calibrating", progress=progress, unit="batch")):
        inputs = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        check_inputs(plan.graph, inputs, f"rep_dataset batch {index}")
        _check_finite(inputs, index)
        # A model whose ops depend on the batch size runs in batches of the plan's size.
        pieces = cache.parts(inputs)
        parts = device_parts(inputs, params, placed) if len(pieces) == 1 else None
        if parts is None:  # one run (per piece), wherever the inputs and params lie
            runs = [collector_for(cache, piece, observed, rounded, collectors)(params, *piece) for piece in pieces]
        else:  # data parallel: each device runs its part of the batch (dispatched before any is read)
            runs = [collector_for(cache, part, observed, rounded, collectors)(device_params, *part)
                    for device_params, part in parts]
        for name, (edge_id, method, keep_axes) in observed.items():
            # Every step of a loop is a part of the batch, as a device's share is.
            found = [np.asarray(x) for (values, _), _ in runs for x in values.get(edge_id, ())]
            if found:
                out.observe_parts(name, method, found, keep_axes=keep_axes, batch_index=index)
        for (_, grams), layouts in runs:
            for param, (matrix, fourth, total) in grams.items():
                layout, rows = layouts[param]
                out.observe_gram(param, Gram(np.asarray(matrix, np.float64), rows, layout,
                                             np.asarray(fourth, np.float64), np.asarray(total, np.float64)))
        count += 1
    if count == 0:
        raise CalibrationError(
            "rep_dataset yielded no batches; give an iterable of input batches (or a callable "
            "returning one), e.g. [x_calibration[i:i + 32] for i in range(0, len(x_calibration), 32)]."
        )
    return out


def collector_for(cache, inputs, observed, rounded, collectors):
    """The jitted statistics of a batch of these inputs' shapes (traced once
    per graph), returning ``((edge values, grams), layouts)``."""
    graph = cache.graph_for(inputs)
    key = id(graph)
    if key not in collectors:
        layouts: dict = {}
        collectors[key] = (jax.jit(_collector(graph, {e for e, _, _ in observed.values()}, rounded, layouts)),
                           layouts)
    collector, layouts = collectors[key]
    return lambda *args: (collector(*args), layouts)


def _collector(graph, edges, rounded: dict[str, bool], layouts: dict):
    """The jittable statistics of one batch: edge values, and the input Gram
    matrix of each weight in `rounded` (param -> whether its algorithm
    requires one: where not, a weight GPTQ cannot read is left out);
    `layouts` gets each such weight's (`WeightLayout`, rows per batch) as the
    function is traced."""
    reads = {op.id: [(i, o.param) for i, o in enumerate(op.operands) if o.role == "weight" and o.param in rounded]
             for op in graph.ops}
    reads = {op_id: found for op_id, found in reads.items() if found}

    def collect(params, *inputs):
        seen, grams, traced, left_out = {}, {}, {}, set()

        def on_edge(edge_id, x):
            if edge_id in edges:  # an edge inside a loop is seen at every step
                seen.setdefault(edge_id, []).append(x)
            return x

        def on_op(op_id, compute, *operands):
            for index, param in reads.get(op_id, ()):
                found = _weight_inputs(graph, graph.op(op_id), compute, operands, index, rounded[param])
                if found is None or param in left_out:
                    left_out.add(param)  # not required: every reader or none
                    continue
                layout, patches = found
                if patches.shape[0] > _MAX_ROWS:  # an even sample of the positions is enough
                    patches = patches[::-(-patches.shape[0] // _MAX_ROWS)]
                gram = jnp.einsum("rgi,rgj->gij", patches, patches, precision=jax.lax.Precision.HIGHEST)
                fourth = jnp.sum(jnp.sum(patches * patches, axis=-1) ** 2, axis=0)
                total = jnp.sum(patches.astype(jnp.float32), axis=0)
                before = grams.get(param, (0, 0, 0))
                grams[param] = (before[0] + gram, before[1] + fourth, before[2] + total)
                known_layout, rows = traced.get(param, (layout, 0))
                if known_layout != layout and not rounded[param]:
                    left_out.add(param)
                    continue
                if known_layout != layout:
                    raise CalibrationError(
                        f"Weight {param!r} is read in two layouts ({known_layout}, and {layout} by op "
                        f"{op_id!r}); its algorithm needs one. Round it to nearest (a rule for this "
                        "module with weight_algorithm=odmlq.Nearest()).")
                traced[param] = (layout, rows + patches.shape[0])
            return compute(*operands)

        graph.evaluate(params, *inputs, on_edge=on_edge, on_op=on_op if reads else None)
        layouts.clear()
        layouts.update({p: v for p, v in traced.items() if p not in left_out})  # static, once traced
        return seen, {p: g for p, g in grams.items() if p not in left_out}

    return collect


def _weight_inputs(graph, op, compute, operands, index: int, required: bool):
    """The weight's layout, in the parameter's own axes, and its input patches
    (None where there are none and they are not `required`).

    The op may read the parameter laid out otherwise (GPT-2's Conv1D reads its
    kernel transposed): a 2-d weight is mapped back by its contracted axis;
    any other must be read as stored."""
    operand = op.operands[index]
    found = weight_inputs(compute, operands, index)
    if not isinstance(found, str):
        layout, patches = found
        stored = tuple(graph.params[operand.param][0])
        if stored == tuple(operand.shape) and operand.channel_axes == layout.out_axes:
            return layout, patches
        if len(stored) == 2 and len(layout.in_axes) == 1 and len(operand.contraction_axes or ()) == 1:
            (axis,) = operand.contraction_axes
            return WeightLayout(out_axes=(1 - axis,), in_axes=(axis,)), patches
        found = "it reads the parameter laid out otherwise than stored"
    if not required:
        return None
    raise CalibrationError(
        f"Op {op.id!r} (module {op.module_path!r}): weight {operand.param!r} has a weight algorithm, "
        f"which needs the inputs of the matmul that reads it, but {found}; round it to nearest "
        "(a rule for this module with weight_algorithm=odmlq.Nearest(), or GPTQ(required=False), which "
        "leaves out what it cannot read).")


def _check_finite(inputs: tuple, index: int) -> None:
    for i, x in enumerate(jax.tree_util.tree_leaves(inputs)):
        x = np.asarray(x)
        if np.issubdtype(x.dtype, np.floating):
            bad = int(np.size(x) - np.count_nonzero(np.isfinite(x)))
            if bad:
                raise CalibrationError(
                    f"rep_dataset batch {index}, input {i}: {bad} NaN or Inf value(s); clean the "
                    "representative data (calibration ranges would be meaningless)."
                )
