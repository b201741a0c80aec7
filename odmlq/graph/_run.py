"""Running a planned model on real inputs (internal).

A plan is traced for its example inputs' shapes. Batches of other sizes are
traced again (cached per shape); the op and edge ids must come out the same,
which they do for models whose structure does not depend on the batch size.
Where it does (``jnp.matmul`` drops batch axes of size 1, so a model planned
at batch 1 traces other ops at batch 4), `GraphCache.parts` cuts a batch into
rows of the plan's batch size, which trace as the plan did.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import numpy as np

from odmlq.errors import CalibrationError, PlanError
from odmlq.graph._keras import is_keras, keras_state
from odmlq.graph._graph import Graph
from odmlq.graph._params import params_tree
from odmlq.graph._trace import trace


def params_for(model: Any, variables: Any, what: str) -> Any:
    if isinstance(model, nn.Module):
        if variables is None:
            raise PlanError(
                f"{what} runs the Linen model {type(model).__name__} and needs its variables: "
                "pass variables=..."
            )
        return variables
    if variables is None and is_keras(model):
        return keras_state(model)
    return model if variables is None else variables


def check_inputs(graph: Graph, inputs: tuple, where: str) -> tuple:
    """Checks inputs against the traced example inputs (any batch size)."""
    leaves = jax.tree_util.tree_leaves(inputs)
    if len(leaves) != len(graph.inputs):
        raise CalibrationError(
            f"{where}: got {len(leaves)} input array(s), the model takes {len(graph.inputs)} "
            f"({', '.join(graph.inputs)})."
        )
    for i, (x, edge_id) in enumerate(zip(leaves, graph.inputs)):
        edge = graph.edges[edge_id]
        shape, dtype = tuple(np.shape(x)), str(np.asarray(x).dtype) if not hasattr(x, "dtype") else str(x.dtype)
        if shape[1:] != edge.shape[1:] or len(shape) != len(edge.shape) or dtype != edge.dtype:
            raise CalibrationError(
                f"{where}, input {i}: shape {shape} {dtype} does not match the example input "
                f"{edge.shape} {edge.dtype} (only the batch size may differ)."
            )
    return inputs


class GraphCache:
    """Graphs of one model for each input shape, with the plan's ids."""

    def __init__(self, model: Any, plan, variables: Any):
        self.model, self.plan, self.variables = model, plan, variables
        self._graphs: dict[tuple, Graph] = {}
        self._split: set[tuple] = set()  # input shapes run in parts of the plan's batch size
        self._float: dict[tuple, Any] = {}  # input shapes -> the float model's graph, jitted
        if plan.graph.program is not None:
            self._graphs[self._key(plan.graph)] = plan.graph

    @staticmethod
    def _key(graph: Graph) -> tuple:
        return tuple((graph.edges[e].shape, graph.edges[e].dtype) for e in graph.inputs)

    def parts(self, inputs: tuple) -> list[tuple]:
        """`inputs` as batches whose graphs have the plan's ops: ``[inputs]``
        itself, or, for a model whose ops depend on the batch size, its rows
        cut into batches of the plan's batch size (and a smaller last one)."""
        key = self._key_of(inputs)
        if key in self._graphs:  # traced already with the plan's ops: every call of a shape after its first
            return [inputs]
        size = self._batch_size(self.plan.graph)
        rows = {np.shape(x)[0] for x in jax.tree_util.tree_leaves(inputs) if np.ndim(x)}
        if key not in self._split:
            try:
                self.graph_for(inputs)
                return [inputs]
            except PlanError:
                if size is None or len(rows) != 1 or rows == {size}:
                    raise
                self._split.add(key)
        (n,) = rows
        parts = [jax.tree.map(lambda x, i=i: x[i:i + size], inputs) for i in range(0, n, size)]
        for part in parts:
            self.graph_for(part)
        return parts

    def run(self, inputs: tuple, run, *, capturing: bool = False) -> Any:
        """``run(*inputs)``, or, for a model whose ops depend on the batch size
        (`parts`), `run` on each part with the outputs joined along the batch
        axis. `capturing`: the run captures or feeds edges, which are laid out
        by the graph that made them: only batches of the plan's size."""
        pieces = self.parts(inputs)
        if len(pieces) == 1:
            return run(*inputs)
        rows = np.shape(jax.tree_util.tree_leaves(inputs)[0])[0]
        if capturing:
            raise PlanError(f"{self.plan.graph.model_name} traces other ops at batch size {rows} than the "
                            "plan's; capture or feed edges with batches of the plan's batch size.")
        runs = [run(*piece) for piece in pieces]
        sizes = [np.shape(jax.tree_util.tree_leaves(piece)[0])[0] for piece in pieces]
        if any(np.ndim(x) == 0 or np.shape(x)[0] != n for out, n in zip(runs, sizes)
               for x in jax.tree_util.tree_leaves(out)):
            raise PlanError(f"{self.plan.graph.model_name} traces other ops at batch size {rows} than the "
                            "plan's, and its outputs do not lead with the batch axis; run it in batches of "
                            "the plan's batch size.")
        return jax.tree.map(lambda *xs: jax.numpy.concatenate(xs), *runs)

    def float_run(self, params: Any, inputs: tuple) -> Any:
        """The float model's outputs on `inputs`, its graph for their shape
        jitted once (a graph evaluated eagerly compiles each of its ops'
        primitives on its first run: 42 programs, 3 s, for a small ResNet)."""
        key = self._key_of(inputs)
        if key not in self._float:
            graph = self.graph_for(inputs)
            self._float[key] = jax.jit(lambda tree, *xs: graph.evaluate(tree, *xs))
        return self._float[key](params_tree(params), *inputs)

    @staticmethod
    def _batch_size(graph: Graph) -> int | None:
        sizes = {graph.edges[e].shape[0] for e in graph.inputs if graph.edges[e].shape}
        return sizes.pop() if len(sizes) == 1 else None

    @staticmethod
    def _key_of(inputs: tuple) -> tuple:
        return tuple((tuple(np.shape(x)), str(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype))
                     for x in jax.tree_util.tree_leaves(inputs))

    def graph_for(self, inputs: tuple) -> Graph:
        key = self._key_of(inputs)
        if key not in self._graphs:
            shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype
                                                                           if not hasattr(x, "dtype") else x.dtype),
                                            tuple(inputs))
            graph = trace(self.model, *shapes, variables=self.variables, method=self.plan.graph.method)
            if [o.id for o in graph.ops] != [o.id for o in self.plan.graph.ops]:
                raise PlanError(
                    f"Tracing {graph.model_name} for input shapes {[s.shape for s in jax.tree_util.tree_leaves(shapes)]} gives "
                    "other ops than the plan's; plan with inputs of this shape instead (or give "
                    "batches of the plan's batch size)."
                )
            self._graphs[key] = graph
        return self._graphs[key]
