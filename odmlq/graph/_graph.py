"""The traced graph of a model: ops, activation edges and weights.

`trace(model, *example_inputs)` turns a Flax model (Linen with its variables,
NNX, or a plain ``fn(params, *inputs)``) into a `Graph`:

- an `Op` per computation on activations, with a stable id
  (``{module_path}/{kind}``, suffixed ``_1``, ``_2`` on repeats) and the module
  path it came from;
- an `Edge` per activation tensor (model inputs, op outputs), named after the
  op that produces it (model inputs are ``input_0``, ``input_1``, ...);
- weights: computations on parameters alone are folded into the operand that
  consumes them, so a Dense's bias ``reshape`` is not an op, and a weight
  operand knows the parameter it comes from and which of that parameter's
  axes are output channels and contraction axes.

A matmul or convolution followed by an ``add`` of a weight is one op (the
bias is fused, as LiteRT and XLA kernels do). ``jnp.einsum`` is one op.
``jax.nn`` functions that JAX keeps as named calls (relu, relu6, sigmoid,
...) are one op each; other calls are inlined (silu is its ``logistic`` and
``mul``, hard_swish its ``add``, ``relu6``, ``div`` and ``mul``: integer
kernels XNNPACK runs), and the functions traced as several primitives
(``jax.nn.gelu`` in both forms, ``jax.nn.softmax``, ``jnp.mean``) are matched
back into one op each (see ``_patterns``). Literals and closed-over arrays that
an op reads are its ``constant`` operands, with their values. Loops made by
``nn.scan`` are a ``scan`` op whose body ops are listed with ``region`` set to
it; stacked weights keep their stacking axis (each layer gets its own scales).

The graph is also evaluable (`Graph.evaluate`) with a hook on every edge,
which is how calibration, simulation and reports observe and rewrite tensors.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

__all__ = ["Edge", "Graph", "MATMUL_KINDS", "MAX_CONSTANT_SIZE", "Op", "Operand"]

# Constant operands up to this many elements keep their value in the graph
# (and in a plan's JSON); a scalar or per-channel constant is far below it.
MAX_CONSTANT_SIZE = 65536
# Op kinds that contract an activation with a weight (or another activation):
# the kinds that carry weight specs, int32 biases and dynamic-range kernels.
MATMUL_KINDS = frozenset({"dot_general", "conv", "einsum"})


# Op kinds that move values without computing new ones (`Graph.output_writers`).
MOVES_VALUES = frozenset({"reshape", "squeeze", "transpose", "broadcast_in_dim", "expand_dims", "copy",
                           "convert_element_type"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Operand:
    """One input of an op.

    Attributes:
      role: ``'input'`` (an activation edge), ``'weight'`` (derived from
        parameters), ``'bias'`` (a weight added after a matmul/conv),
        ``'fold'`` (a per-channel weight of an affine epilogue folded into the
        matmul/conv: an inference BatchNorm, see `Op.attributes['fold']`) or
        ``'constant'`` (a literal or closed-over array).
      edge: the activation edge id, for role ``'input'``.
      param: the parameter path (``'conv1/kernel'``) for weights and biases.
      shape, dtype: of the operand as the op sees it.
      channel_axes: the parameter's output-channel axes for this op (None when
        they cannot be mapped back to the parameter's layout).
      contraction_axes: the parameter's contracted axes (matmul/conv inputs).
      stacked_axes: parameter axes that a loop slices (one slice per
        iteration): every slice gets its own scales.
      derived: a weight computed from parameters by arithmetic (``scale *
        rsqrt(var + eps)``), not only laid out (reshaped, transposed): a
        backend cannot store it as the parameter's integers.
      value: for a constant, its value (folded at trace time; None when it
        could not be folded or has more than `MAX_CONSTANT_SIZE` elements,
        which plans do not carry: such a constant is not quantized).
    """

    role: str
    edge: str | None = None
    param: str | None = None
    shape: tuple[int, ...] = ()
    dtype: str = "float32"
    channel_axes: tuple[int, ...] | None = ()
    contraction_axes: tuple[int, ...] | None = ()
    stacked_axes: tuple[int, ...] = ()
    derived: bool = False
    value: Any = dataclasses.field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k in ("shape", "channel_axes", "contraction_axes", "stacked_axes"):
            if d[k] is not None:
                d[k] = list(d[k])
        d["value"] = None if self.value is None else np.asarray(self.value).tolist()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Operand":
        d = dict(d)
        for k in ("shape", "channel_axes", "contraction_axes", "stacked_axes"):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        if d.get("value") is not None:
            d["value"] = np.asarray(d["value"], d.get("dtype", "float32")).reshape(d["shape"])
        return cls(**d)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Op:
    """One operation on activations, with the module path it came from."""

    id: str
    kind: str
    module_path: str
    operands: tuple[Operand, ...]
    outputs: tuple[str, ...]
    region: str | None = None
    attributes: dict = dataclasses.field(default_factory=dict)

    @property
    def weights(self) -> tuple[Operand, ...]:
        return tuple(o for o in self.operands if o.role in ("weight", "bias"))

    @property
    def folds(self) -> tuple[Operand, ...]:
        """Per-channel weights folded into this matmul/conv (an inference BatchNorm)."""
        return tuple(o for o in self.operands if o.role == "fold")

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(o.edge for o in self.operands if o.role == "input")

    @property
    def constants(self) -> tuple[Operand, ...]:
        """Constant operands (literals, closed-over arrays), in operand order."""
        return tuple(o for o in self.operands if o.role == "constant")

    def to_dict(self) -> dict:
        return {
            "id": self.id, "kind": self.kind, "module_path": self.module_path,
            "operands": [o.to_dict() for o in self.operands],
            "outputs": list(self.outputs), "region": self.region,
            "attributes": dict(self.attributes),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Op":
        return cls(
            id=d["id"], kind=d["kind"], module_path=d["module_path"],
            operands=tuple(Operand.from_dict(o) for o in d["operands"]),
            outputs=tuple(d["outputs"]), region=d.get("region"),
            attributes=dict(d.get("attributes", {})),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Edge:
    """An activation tensor: a model input or an op output.

    `alias` names the edge whose values this one carries (a loop's carry
    inside its body, a loop's result outside it); an alias takes the
    quantization spec of what it aliases.
    """

    id: str
    shape: tuple[int, ...]
    dtype: str
    producer: str | None
    consumers: tuple[str, ...] = ()
    is_input: bool = False
    is_output: bool = False
    alias: str | None = None

    @property
    def is_float(self) -> bool:
        return self.dtype.startswith(("float", "bfloat"))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["shape"], d["consumers"] = list(self.shape), list(self.consumers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Edge":
        d = dict(d)
        d["shape"], d["consumers"] = tuple(d["shape"]), tuple(d["consumers"])
        return cls(**d)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Graph:
    """Ops in execution order, edges by id, and the model's parameters.

    A graph read back from JSON describes the model but cannot be evaluated;
    trace the model again for that.
    """

    ops: tuple[Op, ...]
    edges: dict[str, Edge]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: dict[str, tuple[tuple[int, ...], str]]
    framework: str
    model_name: str
    program: Any = dataclasses.field(default=None, compare=False, repr=False)
    # The Linen / NNX method traced (None: the model's call); a traced graph of
    # other input shapes traces it again.
    method: Any = dataclasses.field(default=None, compare=False, repr=False)

    def resolve(self, edge_id: str) -> str:
        """The edge an alias edge stands for (itself if not an alias)."""
        while self.edges[edge_id].alias is not None:
            edge_id = self.edges[edge_id].alias
        return edge_id

    @functools.cached_property
    def output_writers(self) -> frozenset[str]:
        """Ops that write a model output: each output's producer and, where that
        op only moves values (reshape, transpose, squeeze, ...), the ops before
        it up to the first that computes (`Rule.writes_output`)."""
        writers, pending = set(), [self.resolve(e) for e in self.outputs if e in self.edges]
        while pending:
            producer = self.edges[pending.pop()].producer
            if producer is None or producer in writers:
                continue
            writers.add(producer)
            op = self.op(producer)
            if op.kind in MOVES_VALUES and op.inputs:
                pending.append(self.resolve(op.inputs[0]))
        return frozenset(writers)

    @functools.cached_property
    def _ops_by_id(self) -> dict[str, Op]:
        return {op.id: op for op in self.ops}

    def op(self, op_id: str) -> Op:
        try:
            return self._ops_by_id[op_id]
        except KeyError:
            raise KeyError(f"No op {op_id!r} in the graph; ops are {[o.id for o in self.ops]}.") from None

    def structured_inputs(self, leaves: list) -> list:
        """The model's inputs (pytrees, where it takes them; None where it takes
        no array) holding `leaves`, one array per `inputs` edge in order."""
        if self.program is None:
            return list(leaves)
        trees = self.program.in_tree.children()[1:]
        out, start = [], 0
        for tree in trees:
            out.append(jax.tree_util.tree_unflatten(tree, leaves[start:start + tree.num_leaves]))
            start += tree.num_leaves
        return out if start == len(leaves) else list(leaves)

    def evaluate(self, params: Any, *inputs: Any,
                 on_edge: Callable[[str, Any], Any] | None = None,
                 on_constant: Callable[[str, int, Any], Any] | None = None,
                 on_op: Callable[..., list] | None = None,
                 on_stack: Callable[[str, list], Any] | None = None,
                 constant_steps: bool = False) -> Any:
        """Runs the model op by op. Jittable.

        Hooks (each returns the value to use):
          on_edge(edge_id, value): every activation edge, inputs included.
          on_constant(op_id, index, value): the `index`-th of an op's
            `constants`, where the op reads it.
          on_op(op_id, compute, *operands) -> outputs: every op but a `scan`
            (whose body's ops are hooked instead), run as one function:
            `operands` are the values of the op's `Operand`s in order
            (weights as the op reads them; a literal's value is passed but
            read from the op, replace it with `on_constant`), `compute(*operands)`
            evaluates the op as traced, and the hook returns the list of its
            outputs (one per `Op.outputs`). A backend wraps an op (in a
            composite, say) or replaces it (a quantized kernel);
            ``jax.make_jaxpr(compute)(*operands)`` shows what it computes.
          on_stack(edge_id, parts): a scan's per-step outputs (unrolled, when
            hooks watch it), to be joined into edge `edge_id` along a new first
            axis; None: ``jnp.stack(parts)``.

        `constant_steps`: compute every step whose operands are all concrete
        at once, also under a trace (``jax.make_jaxpr``): what depends on no
        input (weights as ops read them) reaches the hooks as values, and
        the rest is only traced, never compiled.

        Example:
          >>> graph = trace(model, x, variables=variables)
          >>> y = graph.evaluate(variables, x)   # == model.apply(variables, x)
        """
        if self.program is None:
            raise RuntimeError(
                "This graph was read from JSON and holds no program; trace the model "
                "again (odmlq.plan(model, rules, *inputs)) to evaluate it."
            )
        from odmlq.graph._program import _Hooks

        return self.program.run(params, inputs, _Hooks(on_edge, on_constant, on_op, on_stack, constant_steps))

    def to_dict(self) -> dict:
        return {
            "framework": self.framework, "model_name": self.model_name,
            "inputs": list(self.inputs), "outputs": list(self.outputs),
            "params": {k: [list(s), d] for k, (s, d) in self.params.items()},
            "ops": [o.to_dict() for o in self.ops],
            "edges": [e.to_dict() for e in self.edges.values()],
            # A method given as a function is not written: such a graph describes the model only.
            "method": self.method if isinstance(self.method, str) else None,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Graph":
        return cls(
            ops=tuple(Op.from_dict(o) for o in d["ops"]),
            edges={e["id"]: Edge.from_dict(e) for e in d["edges"]},
            inputs=tuple(d["inputs"]), outputs=tuple(d["outputs"]),
            params={k: (tuple(s), dt) for k, (s, dt) in d["params"].items()},
            framework=d["framework"], model_name=d["model_name"], method=d.get("method"),
        )


def _shape_dtype(x: Any) -> tuple[tuple[int, ...], str]:
    return tuple(int(d) for d in np.shape(x)), str(np.dtype(x.dtype))
