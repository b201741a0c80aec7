"""An export prepared: planned, calibrated and scaled, before conversion (internal;
`export_tflite` and `export_signatures` build on it)."""

from __future__ import annotations

import dataclasses
import functools
import inspect as pyinspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from odmlq.batches import leaf_names, leaves, model_inputs, row_count, sliced
from odmlq.calibration import Calibration, calibrate, calibrated_edges, needs_calibration
from odmlq.errors import CalibrationError, PlanError
from odmlq.graph import GraphCache, check_finite_params, is_keras, keras_input_names, params_for
from odmlq.litert._check import check_io_dtype, check_plan
from odmlq.litert._multipliers import check_add_multipliers
from odmlq.litert._tables import int16_rsqrt_forms
from odmlq.litert.spec import TARGET
from odmlq.plan import Plan, plan as make_plan
from odmlq.scales import Scales, compute_scales

__all__ = ["SCHEMAS", "Prepared", "prepare", "schema_of"]


SCHEMAS = ("static", "dynamic", "weight_only", "float")


def schema_of(plan: Plan) -> str:
    """Which LiteRT schema a plan asks for.

    - ``static``: activations quantized with calibrated ranges (full integer,
      int8 or int16x8);
    - ``dynamic``: int8 weights, activations quantized at run time by the
      kernels (dynamic-range);
    - ``weight_only``: quantized weights, float activations;
    - ``float``: nothing quantized.

    Raises:
      PlanError: static and dynamic activations mixed in one model.
    """
    specs = [p.spec for p in plan.edges.values() if p.spec is not None]
    static = [s for s in specs if not s.dynamic]
    dynamic = [s for s in specs if s.dynamic]
    if static and dynamic:
        edge_id = next(e for e, p in plan.edges.items() if p.spec is not None and p.spec.dynamic)
        producer = plan.graph.edges[edge_id].producer
        rule = None if producer is None else plan.ops[producer].rule
        raise PlanError(
            f"The plan quantizes edge {edge_id!r} at run time (op {producer!r}, rules[{rule}] has "
            "act_dynamic=True) among statically quantized edges: in a full-integer model a dynamic-range "
            "kernel may read a static edge and write float outputs (Rule('.*', writes_output=True, "
            "weight_qtype='int8', act_qtype='int8', act_dynamic=True) before your other rules: a "
            "classifier head), but no edge inside it is quantized at run time. Give act_dynamic=True only "
            "to the ops that write the model's outputs, or make every act rule static or every one dynamic.",
            ops=(producer,) if producer is not None else ())
    if static:
        return "static"
    if dynamic:
        return "dynamic"
    weights = any(w.spec is not None for p in plan.ops.values() for w in p.weights)
    return "weight_only" if weights else "float"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prepared:
    """An export planned, calibrated and scaled, before conversion (internal;
    `export_tflite` and `export_signatures`)."""

    plan: Plan
    calibration: Calibration | None
    scales: Scales
    graph: Any
    example_inputs: tuple
    held_back: list
    float_ops: Any
    schema: str
    rsqrt_pieces: dict = dataclasses.field(default_factory=dict)  # op id -> `_tables.RsqrtPieces`
    io_dtype: str
    input_names: list[str]
    output_names: list[str]


def prepare(model: Any, rules: Sequence | Plan, rep_dataset, *, variables: Any = None,
            example_inputs: Sequence[Any] | None = None, calibration: Calibration | None = None,
            allow_float_ops: bool = False, input_names: Sequence[str] | None = None,
            output_names: Sequence[str] | None = None, io_dtype: str = "float", batch_size: int = 1,
            method: Any = None, progress: bool | None = None, weights: Scales | None = None,
            state: dict[int, int] | None = None) -> Prepared:
    """Everything of `export_tflite` before conversion (see its arguments).
    `weights`: the weights' scales and rounded values to use instead of
    computing them (another signature's, so that one file shares them);
    `state`: as `odmlq.plan`'s, for the plan made from rules."""
    params = params_for(model, variables, "export_tflite")
    check_finite_params(params)
    batches = list(rep_dataset() if callable(rep_dataset) else rep_dataset or [])
    if example_inputs is None:
        example_inputs = _example_inputs(batches, batch_size)
    example_inputs = tuple(example_inputs)
    if isinstance(rules, Plan) and method is not None and method != rules.graph.method:
        raise PlanError(f"method={method!r}, but the plan given traced {rules.graph.method or '__call__'!r}; "
                        "leave method out (the plan carries it) or plan that method.")
    plan = (rules if isinstance(rules, Plan)
            else make_plan(model, rules, *example_inputs, variables=variables, method=method, target=TARGET,
                           state=state))
    float_ops = check_plan(plan, allow_float_ops=allow_float_ops)
    schema = schema_of(plan)
    if io_dtype not in ("float", "int8", "int16"):
        raise PlanError(f"io_dtype={io_dtype!r}; choose 'float', 'int8' or 'int16'.")
    if io_dtype != "float" and schema != "static":
        raise PlanError(f"io_dtype={io_dtype!r} needs a full-integer model; this plan is {schema}.")
    if io_dtype != "float":
        check_io_dtype(plan, io_dtype)
    held_back = batches[-1:] if len(batches) >= 2 else batches
    # Static edges need statistics (an empty rep_dataset is an error there);
    # weights rounded against their inputs (GPTQ, the default) use them where there is data.
    if calibration is None and (calibrated_edges(plan) or (batches and weights is None and needs_calibration(plan))):
        calibration = calibrate(model, plan, batches[:-1] if len(batches) >= 2 else batches,
                                variables=variables, progress=progress)
    if weights is None:
        scales = compute_scales(plan, calibration, params)
    else:
        scales = dataclasses.replace(compute_scales(plan, calibration, params, weight_scales=weights.weights),
                                     weight_values=weights.weight_values)
    check_add_multipliers(plan, scales)
    kept, rsqrt_pieces = int16_rsqrt_forms(plan, scales, calibration, allow_float_ops, float_ops)
    float_ops = [*float_ops, *kept]
    # A plan traced for other input shapes (another batch size) is traced again for these.
    graph = GraphCache(model, plan, variables).graph_for(example_inputs) if plan.graph.program is not None else None
    if graph is None:
        graph = make_plan(model, plan.rules, *example_inputs, variables=variables, method=plan.graph.method,
                          target=TARGET).graph
    return Prepared(plan=plan, calibration=calibration, scales=scales, graph=graph, example_inputs=example_inputs,
                    held_back=held_back, float_ops=float_ops, rsqrt_pieces=rsqrt_pieces, schema=schema, io_dtype=io_dtype,
                    input_names=list(input_names or _input_names(model, example_inputs, plan.graph.method)),
                    output_names=list(output_names or [f"output_{i}" for i in range(len(graph.outputs))]))


def _example_inputs(batches: list, batch_size: int) -> tuple:
    """The first `batch_size` rows of the first batch, after checking it."""
    if not batches:
        raise PlanError("export_tflite needs example_inputs= or a non-empty rep_dataset.")
    first = model_inputs(batches[0])
    for i, value in enumerate(first):
        for path, x in jax.tree_util.tree_flatten_with_path(value)[0]:  # None: an input with no array
            where = f"input {i}{jax.tree_util.keystr(path)}"
            kind = np.asarray(x).dtype.kind
            if kind in "biuf" and np.ndim(x) and np.shape(x)[0] == 0:
                raise CalibrationError(f"rep_dataset batch 0, {where} is empty (shape {np.shape(x)}); "
                                       "give batches with at least one row.")
            if kind not in "biuf":
                raise CalibrationError(
                    f"rep_dataset batch 0, {where}: {type(x).__name__} of dtype {np.asarray(x).dtype} and "
                    f"shape {np.shape(x)}; each batch is an array (or a tuple of them, one per model input; "
                    "an input may be a dict or list of arrays) of numbers with the batch dimension first "
                    "(a scalar is shared by every row).")
    batched = [x for x in leaves(first) if np.ndim(x)]
    if not batched:
        raise CalibrationError("rep_dataset batch 0: every input is a scalar; give the inputs with the batch "
                               "dimension first (x[None] for one row).")
    rows = row_count(first)
    if any(np.shape(x)[0] != rows for x in batched):
        raise CalibrationError(f"rep_dataset batch 0: its arrays have {sorted({np.shape(x)[0] for x in batched})} "
                               "rows; give every input of a batch the same number of rows, or, for inputs with no batch "
                               "dimension (a graph's nodes and edges), example_inputs= (one batch, exported at its "
                               "shapes): each batch is then one example, taken whole.")
    if not isinstance(batch_size, int) or batch_size < 1 or batch_size > rows:
        raise PlanError(f"batch_size={batch_size!r}: give an integer from 1 to the first batch's "
                        f"{rows} rows, or example_inputs= of the shape to export.")
    return sliced(first, 0, batch_size)


def _input_names(model: Any, example_inputs: tuple, method: str | Callable | None = None) -> list[str]:
    """A name per array the .tflite takes: the model's argument names, and a
    pytree input's keys (`odmlq.batches.leaf_names`)."""
    n = len(example_inputs)
    if is_keras(model):
        names = keras_input_names(model) or []
        names = names if len(names) == n else [f"input_{i}" for i in range(n)]
    else:
        names = _argument_names(model, n, method)
    return leaf_names(example_inputs, names)


def _argument_names(model: Any, n: int, method: str | Callable | None) -> list[str]:
    try:
        function = method is not None and not isinstance(method, str)  # a function taking the module first
        plain = function or pyinspect.isfunction(model) or isinstance(model, functools.partial)
        fn = method if function else model if plain else model.__call__ if method is None else getattr(model, method)
        names = [p.name for p in pyinspect.signature(fn).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        names = names[1:] if plain else names  # a plain function takes its params (or module) first
    except (TypeError, ValueError):
        names = []
    return names[:n] if len(names) >= n else [f"input_{i}" for i in range(n)]
