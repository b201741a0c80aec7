"""AWQ: per-input-channel scales moved from a matmul's weight into the op that
makes its input, searched against the calibration data.

A weight-only (or dynamically quantized) matmul ``y = x W`` is exact in float
with ``x' = x / s`` and ``W' = diag(s) W`` for any positive per-channel ``s``
along the contracted axis. Rounding ``W'`` instead of ``W`` gives the input
channels that carry the most energy finer steps, relative to their weights,
and the others coarser ones; with ``s = E[x_c^2]^(alpha/2)`` (normalised by
the geometric middle of its range) the output error on the calibration
inputs, ``sum over readers of d^T H d`` with ``d = diag(1/s) round(W') - W``
and ``H`` the inputs' second moment (`odmlq.calibration.Gram`), is measured
for ``alpha`` from 0 (no scaling) to 1, and the best kept (Lin et al., "AWQ:
Activation-aware Weight Quantization for LLM Compression and Acceleration",
MLSys 2024; they search ``mean |x_c|``, this the root mean square).

``x / s`` must be computable by changing parameters, with the model's float
function unchanged. An edge qualifies when every op that reads it is a
matmul whose quantized integer weight contracts its last axis, it is no model
output, and the op that makes it is linear per channel in parameters of its
own (`_scalable`):

- a multiply by a per-channel parameter (a LayerNorm's or RMSNorm's scale),
  with an add of a per-channel parameter after it (LayerNorm's bias);
- a matmul's output channels (its weight's and bias's);
- a ReLU of such an edge (``relu(x / s) = relu(x) / s`` for ``s > 0``);
- a product of two edges, one of them such an edge read by the product
  alone (a gated MLP's ``silu(gate) * up``: ``up``'s output channels).

Each parameter changed must be read by one op only (a tied embedding, also
the table tokens are looked up in, is left as it is). The result is float
parameters computing the same function (to float32 rounding), so every
backend reads the same weights: quantize them as any model's (GPTQ then
rounds the scaled weights against their own inputs).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from odmlq.errors import RuleError

__all__ = ["AWQResult", "ScaledEdge", "awq"]

ALPHAS = 21  # 0, 0.05, ..., 1
# A scaling is kept only where it lowers its readers' summed output error on
# the calibration inputs by at least this much. On the sample decoder (int4 in
# blocks of 32) every edge gained 0.07-0.48 dB there, and held-out perplexity
# rose (+0.75% -> +0.91% rounded to nearest, +0.06% -> +0.23% with GPTQ): gains
# that small are the calibration sample's, not the model's.
MIN_GAIN_DB = 0.5


@dataclasses.dataclass(frozen=True)
class ScaledEdge:
    """One input edge whose channels were scaled.

    Attributes:
      edge: the edge's id in the plan.
      readers: the weights multiplied by ``s`` along their contracted axis.
      divided: the parameters divided by ``s`` (the op that makes the edge).
      alpha: the exponent chosen.
      error_db: the readers' summed output error on the calibration inputs,
        in dB, against rounding the weights unscaled (negative: lower).
    """

    edge: str
    readers: tuple[str, ...]
    divided: tuple[str, ...]
    alpha: float
    error_db: float


@dataclasses.dataclass(frozen=True)
class AWQResult:
    """`variables`: the model's variables with the scales moved (float, the
    same function); `scaled`: what changed; `skipped`: edges read by quantized
    matmuls that could not be scaled, with why."""

    variables: Any
    scaled: tuple[ScaledEdge, ...]
    skipped: dict[str, str]

    def __str__(self) -> str:
        lines = [f"AWQ: {len(self.scaled)} input edge(s) scaled, {len(self.skipped)} left as they are"]
        for s in self.scaled:
            lines.append(f"  {s.edge}: alpha {s.alpha:.2f}, readers' error {s.error_db:+.2f} dB "
                         f"({', '.join(s.readers)}; divided: {', '.join(s.divided)})")
        for edge, why in self.skipped.items():
            lines.append(f"  {edge}: not scaled ({why})")
        return "\n".join(lines)


def awq(model: Any, rules, rep_dataset: Iterable | Callable[[], Iterable], *, variables: Any = None,
        method: Any = None, min_gain_db: float = MIN_GAIN_DB) -> AWQResult:
    """Moves per-input-channel scales into the ops before the quantized
    matmuls of `rules`, as AWQ does, and returns the new float variables.

    Args:
      model: a Linen module (pass `variables`) or ``fn(params, *inputs)``.
      rules: the rules the model will be quantized with (their weight qtype
        and granularity are what the search rounds to); weight-only or
        dynamic matmuls are scaled, not statically quantized inputs (whose
        ranges the scaling would change).
      rep_dataset: calibration batches, as `odmlq.calibrate` takes them.
      variables: Linen variables, or the params of a plain function.
      method: the Linen method to trace (default ``__call__``).
      min_gain_db: an edge is scaled only where its readers' output error on
        the calibration inputs drops by at least this many dB (smaller gains
        did not hold on held-out data).

    Returns:
      An `AWQResult`; quantize with its `variables` and the same rules.

    Example:
      >>> rules = [odmlq.Rule('.*', op='dot_general', weight_qtype='int4',
      ...                     weight_granularity=odmlq.PerBlock(32))]
      >>> scaled = odmlq.awq(model, rules, batches, variables=variables)
      >>> qmodel = odmlq.ptq(model, rules, scaled.variables, odmlq.calibrate(...))
    """
    from odmlq.algorithms import GPTQ
    from odmlq.calibration import calibrate
    from odmlq.graph import flat_params, is_nnx_module, params_for, replace_params
    from odmlq.plan import check_rules
    from odmlq.plan import plan as make_plan

    if isinstance(min_gain_db, bool) or not isinstance(min_gain_db, (int, float)) or not min_gain_db >= 0:
        raise RuleError(f"odmlq.awq(min_gain_db={min_gain_db!r}): give a number of dB >= 0, e.g. 0.5.")
    if is_nnx_module(model):
        raise RuleError("odmlq.awq takes a Linen module or fn(params, *inputs); for an NNX module, "
                        "pass nnx.split's graphdef call as fn(params, *inputs) with its state as variables.")
    batches = list(rep_dataset() if callable(rep_dataset) else rep_dataset)
    if not batches:
        raise RuleError("odmlq.awq: rep_dataset yielded no batches; give calibration inputs.")
    example = tuple(batches[0]) if isinstance(batches[0], (tuple, list)) else (batches[0],)
    # Every quantized weight's input second moment (what GPTQ collects).
    rules = [r if r.skip or r.weight_qtype is None else dataclasses.replace(r, weight_algorithm=GPTQ(required=False))
             for r in check_rules(rules)]
    plan = make_plan(model, rules, *example, variables=variables, method=method)
    calibration = calibrate(model, plan, batches, variables=variables, progress=False)
    params = params_for(model, variables, "awq")
    originals = flat_params(params)
    values: dict[str, np.ndarray] = {}  # float64 copies of the parameters read so far, scaled as they go

    def value(name):
        if name not in values:
            values[name] = np.asarray(originals[name], np.float64)
        return values[name]

    specs = plan.weight_specs()
    new: dict[str, np.ndarray] = {}
    scaled, skipped = [], {}
    flow = _Flow.of(plan.graph)
    for edge, readers in _candidate_edges(plan, specs, flow).items():
        why = _unscalable_readers(plan, edge, readers, specs, calibration, flow)
        divided = None if why else _scalable(plan.graph, edge, flow)
        if why or divided is None:
            skipped[edge] = why or "the op that makes it is not linear per channel in parameters of its own"
            continue
        weights = {op.id: _weight_operand(op) for op in readers}
        found = _search([(value(w.param), w.contraction_axes[0], specs[w.param], calibration.grams[w.param])
                         for w in weights.values()])
        if found is None or found[2] > -min_gain_db:
            skipped[edge] = ("no scaling lowers its readers' output error" if found is None else
                             f"the best scaling lowers its readers' output error by {-found[2]:.2f} dB only")
            continue
        s, alpha, error_db = found
        for w in weights.values():
            new[w.param] = _along(value(w.param), s, w.contraction_axes[0])
        for param, axis in divided:
            new[param] = _along(value(param), 1.0 / s, axis)
        scaled.append(ScaledEdge(edge=edge, readers=tuple(w.param for w in weights.values()),
                                 divided=tuple(p for p, _ in divided), alpha=alpha, error_db=error_db))
        values.update(new)
    out = replace_params(params, {k: v.astype(np.asarray(originals[k]).dtype) for k, v in new.items()})
    return AWQResult(variables=out, scaled=tuple(scaled), skipped=skipped)


@dataclasses.dataclass(frozen=True)
class _Flow:
    """Who reads and who makes each edge (aliases resolved), the model's
    outputs, and how many ops read each parameter."""

    readers: dict[str, list]
    producers: dict[str, Any]
    outputs: frozenset
    uses: Counter

    @classmethod
    def of(cls, graph) -> "_Flow":
        readers: dict[str, list] = {}
        producers = {}
        for op in graph.ops:
            for e in op.inputs:
                readers.setdefault(graph.resolve(e), []).append(op)
            for e in op.outputs:
                producers[graph.resolve(e)] = op
        uses = Counter(o.param for op in graph.ops for o in op.operands if o.param is not None)
        return cls(readers, producers, frozenset(graph.resolve(e) for e in graph.outputs), uses)

    def read_once(self, edge: str) -> bool:
        """Whether one op alone reads `edge`, and it is no model output."""
        return len(self.readers.get(edge, ())) == 1 and edge not in self.outputs


def _weight_operand(op):
    return next(o for o in op.operands if o.role == "weight")


def _candidate_edges(plan, specs, flow: _Flow) -> dict[str, list]:
    """Input edges of matmuls with a quantized weight, and every op reading each."""
    graph = plan.graph
    out = {}
    for op in graph.ops:
        if op.kind != "dot_general" or len(op.inputs) != 1:
            continue
        weight = next((o for o in op.operands if o.role == "weight"), None)
        if weight is not None and weight.param in specs:
            edge = graph.resolve(op.inputs[0])
            out.setdefault(edge, flow.readers[edge])
    return out


def _unscalable_readers(plan, edge, readers, specs, calibration, flow: _Flow) -> str | None:
    """Why the readers of `edge` cannot take its scale (None: they can)."""
    graph = plan.graph
    if edge in flow.outputs:
        return "it is a model output"
    if edge in graph.inputs:
        return "it is a model input"
    spec = plan.edge_spec(edge)
    if spec is not None and not getattr(spec, "dynamic", False):
        return "it is quantized statically (scaling it would change its range)"
    channels = graph.edges[edge].shape[-1] if graph.edges[edge].shape else None
    for op in readers:
        operands = [o for o in op.operands if o.role == "input"]
        weight = next((o for o in op.operands if o.role == "weight"), None)
        if op.kind != "dot_general" or weight is None or len(operands) != 1 or weight.param not in specs:
            return f"{op.id} reads it and is not a matmul with a quantized weight"
        x = operands[0]
        if tuple(x.contraction_axes or ()) != (len(x.shape) - 1,):
            return f"{op.id} does not contract its last axis"
        if weight.derived or weight.stacked_axes or len(weight.contraction_axes or ()) != 1:
            return f"{op.id}'s weight is not one parameter with one contracted axis"
        if flow.uses[weight.param] != 1:
            return f"{op.id}'s weight {weight.param!r} is read by other ops too (a tied embedding)"
        if weight.param not in calibration.grams or specs[weight.param].qtype.kind != "int":
            return f"{op.id}'s weight has no integer spec with observed inputs"
        gram = calibration.grams[weight.param]
        if gram.matrix.shape[0] != 1 or gram.matrix.shape[1] != channels:
            return f"{op.id}'s inputs are not its edge's channels"
    return None


def _scalable(graph, edge, flow: _Flow, _depth: int = 0) -> list[tuple[str, int]] | None:
    """The (parameter, axis) pairs that, divided by ``s`` along the axis,
    divide channel c of `edge` by ``s_c`` and change nothing else; None if
    there are none (see the module doc)."""
    op = flow.producers.get(edge)
    if op is None or len(op.outputs) != 1 or _depth > 8:
        return None
    channels = graph.edges[edge].shape[-1]
    inputs = [graph.resolve(e) for e in op.inputs]
    weights = [o for o in op.operands if o.role in ("weight", "bias")]
    if any(flow.uses[w.param] != 1 or w.derived or w.stacked_axes for w in weights) or op.constants:
        return None

    def vector(w):
        return graph.params[w.param][0] in ((channels,),) and w.shape[-1] == channels

    if op.kind == "mul" and len(inputs) == 1 and len(weights) == 1 and vector(weights[0]):
        return [(weights[0].param, 0)]
    if op.kind == "add" and len(inputs) == 1 and len(weights) == 1 and vector(weights[0]) \
            and flow.read_once(inputs[0]):
        below = _scalable(graph, inputs[0], flow, _depth + 1)
        return None if below is None else below + [(weights[0].param, 0)]
    if op.kind == "relu" and len(inputs) == 1 and not weights and flow.read_once(inputs[0]):
        return _scalable(graph, inputs[0], flow, _depth + 1)
    if op.kind == "mul" and len(inputs) == 2 and not weights and inputs[0] != inputs[1]:
        for e in inputs:
            if graph.edges[e].shape == graph.edges[edge].shape and flow.read_once(e):
                below = _scalable(graph, e, flow, _depth + 1)
                if below is not None:
                    return below
        return None
    if op.kind == "dot_general" and len(inputs) == 1 and op.operands[0].role == "input":
        kernel = [w for w in weights if w.role == "weight"]
        bias = [w for w in weights if w.role == "bias"]
        if len(kernel) != 1 or len(kernel[0].channel_axes or ()) != 1 or len(bias) > 1:
            return None
        axis = kernel[0].channel_axes[0]
        if graph.params[kernel[0].param][0][axis] != channels or any(not vector(b) for b in bias):
            return None
        return [(kernel[0].param, axis)] + [(b.param, 0) for b in bias]
    return None


def _along(w: np.ndarray, s: np.ndarray, axis: int) -> np.ndarray:
    shape = [1] * w.ndim
    shape[axis] = s.size
    return w * s.reshape(shape)


def _rounded(w: np.ndarray, spec) -> np.ndarray:
    """`w` rounded to nearest with the scales `spec` gives it, dequantized."""
    from odmlq.scales import weight_scale

    w32 = w.astype(np.float32)
    return np.asarray(weight_scale(w32, spec).fake_quant(w32), np.float64)


def _search(readers: Sequence[tuple[np.ndarray, int, Any, Any]]):
    """``(s, alpha, error_db)`` of the best exponent, or None when none beats
    ``alpha = 0`` (each reader: weight, contracted axis, spec, Gram)."""
    gram = readers[0][3]
    h = gram.matrix[0] / max(gram.rows, 1)
    energy = np.sqrt(np.maximum(np.diag(h), 0.0))
    if not np.any(energy > 0):
        return None
    energy = np.where(energy > 0, energy, energy[energy > 0].min())

    def error(s):
        total = 0.0
        for w, axis, spec, g in readers:
            d = _along(_rounded(_along(w, s, axis), spec), 1.0 / s, axis) - w
            m = g.layout.matrix(d)[0]  # (outputs, channels)
            total += float(np.sum((m @ h) * m))
        return total

    tried = []
    for alpha in np.linspace(0.0, 1.0, ALPHAS):  # alpha 0: s = 1, the weights as they are
        s = energy ** alpha
        s = s / np.sqrt(s.max() * s.min())
        tried.append((error(s), s, float(alpha)))
    base = tried[0][0]
    best = min(tried, key=lambda t: t[0])
    if best[2] == 0.0 or not best[0] < base or base <= 0:
        return None
    return best[1], best[2], float(10 * np.log10(best[0] / base))
