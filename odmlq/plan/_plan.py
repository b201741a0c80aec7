"""The Plan: what every tensor edge and weight of a traced model becomes.

`plan(model, rules, *example_inputs)` traces the model once and applies the
rules: each op gets the first rule that matches it, its weights and output
edges get resolved `QuantSpec`s, activation inputs take their producer's spec
and model inputs their first consumer's. The Plan is the single source of
truth: backends and reports read it and never re-decide.

Example:
  >>> p = plan(model, [Rule('.*', weight_qtype='int8', act_qtype='int8')], x, variables=v)
  >>> print(p)            # an aligned table of ops and edges
  >>> Plan.from_json(p.to_json()) == p
  True
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from odmlq.constraints import Constraint, Target, combine_targets, constraint_from_dict
from odmlq.errors import PlanError, RuleError
from odmlq.graph import MATMUL_KINDS, Graph, Op, trace
from odmlq.plan._passes import (
    FLOAT_ACTIVATION,
    FROM_INTEGERS,
    calibrate_masks,
    calibrate_norms,
    carry_float_inputs,
    dynamic_only_into_kernels,
    dynamic_per_row,
    float_activations,
    float_from_integers,
    fuse_activations,
    resolve_output_constraints,
    share_scale_of_activations_beside_others,
)
from odmlq.plan._spec import QuantSpec, spec_or_none as _spec_or_none
from odmlq.plan._outputs import float_output_ops, floated
from odmlq.plan._shared import share_weight_specs
from odmlq.plan._state import check_state_specs, state_indices, state_pairs
from odmlq.plan._specs_of import act_spec, constant_operand_spec, constant_specs, dynamic_input_spec, weight_spec
from odmlq.rules import Rule, rules_from_dicts, rules_to_dicts, warn_unmatched

__all__ = ["EdgePlan", "OpPlan", "Plan", "QuantSpec", "WeightPlan", "check_rules", "plan", "plan_graph"]

PLAN_FORMAT_VERSION = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightPlan:
    """The plan for one weight operand of an op (`spec` None: float).

    Attributes:
      read_as: for a value an elementwise integer kernel reads that is not
        stored as the weight spec says (one derived from parameters by
        arithmetic: an embedding gathered at constant positions,
        ``scale * rsqrt(var)``; or a weight of another qtype than the op's
        activations: an int16 MUL's LayerNorm scale): the spec it is quantized
        to where the op reads it, per tensor from its own value, like a
        constant operand (the parameter itself is not stored quantized).
        None: not so.
    """

    param: str
    role: str
    spec: QuantSpec | None
    note: str = ""
    read_as: QuantSpec | None = None

    def to_dict(self) -> dict:
        return {"param": self.param, "role": self.role, "note": self.note,
                "spec": None if self.spec is None else self.spec.to_dict(),
                "read_as": None if self.read_as is None else self.read_as.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "WeightPlan":
        return cls(param=d["param"], role=d["role"], note=d.get("note", ""),
                   spec=_spec_or_none(d["spec"]), read_as=_spec_or_none(d.get("read_as")))


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpPlan:
    """The rule that decided an op (None: no rule matched, float), its weights,
    and its constant operands (one spec or None per `Op.constants`, in order).

    Attributes:
      skip: a skip rule keeps the op in float, or it is the activation a float
        op's kernel applies (`plan._passes.float_activations`).
      dynamic_input: the spec a matmul/conv kernel quantizes its float inputs
        with at run time (a dynamic rule), or None.
      dynamic_inputs_float: a target has no dynamic kernel for this op (it
        reads no quantized constant, and LiteRT's dynamic-range kernels need
        one: an attention matmul), so every backend reads its dynamically
        quantized inputs in float.
      inputs_float: a target computes this op in float only
        (`Target.float_kinds`: LiteRT's SIN, ELU...), so every backend reads
        its float inputs as they are, never quantized for it (`conversions`).
    """

    op: str
    rule: int | None
    weights: tuple[WeightPlan, ...] = ()
    constants: tuple[QuantSpec | None, ...] = ()
    skip: bool = False
    dynamic_input: QuantSpec | None = None
    dynamic_inputs_float: bool = False
    inputs_float: bool = False

    def to_dict(self) -> dict:
        return {"op": self.op, "rule": self.rule, "weights": [w.to_dict() for w in self.weights],
                "constants": [None if c is None else c.to_dict() for c in self.constants],
                "skip": self.skip,
                "dynamic_input": None if self.dynamic_input is None else self.dynamic_input.to_dict(),
                "dynamic_inputs_float": self.dynamic_inputs_float, "inputs_float": self.inputs_float}

    @classmethod
    def from_dict(cls, d: dict) -> "OpPlan":
        return cls(op=d["op"], rule=d["rule"],
                   weights=tuple(WeightPlan.from_dict(w) for w in d["weights"]),
                   constants=tuple(_spec_or_none(c) for c in d.get("constants", ())),
                   skip=bool(d.get("skip", False)), dynamic_input=_spec_or_none(d.get("dynamic_input")),
                   dynamic_inputs_float=bool(d.get("dynamic_inputs_float", False)),
                   inputs_float=bool(d.get("inputs_float", False)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class EdgePlan:
    """The spec of one activation edge, where it came from, and what the
    plan's targets require of its scale.

    Attributes:
      constraint: the target's requirement on this edge's scale
        (`odmlq.constraints`: same as the input's, shared with the consuming
        op's inputs, or fixed), resolved when the plan was made; None: the
        scale comes from calibration.
      fused_into: the activation op this edge is fused into (the kernel
        applies it before requantizing: the edge is never materialized).
      alternative: for a model output planned float (`Rule.float_outputs`),
        the static spec its rule gives it: calibrated, and taken where
        `odmlq.compute_scales` finds that the dynamic-range kernel's second
        rounding of its input would cost more (`Scales.int8_outputs`).
    """

    edge: str
    spec: QuantSpec | None
    rule: int | None
    reason: str
    constraint: Constraint | None = None
    fused_into: str | None = None
    alternative: QuantSpec | None = None

    @property
    def fused(self) -> bool:
        """Not materialized: fused into the activation that consumes it."""
        return self.fused_into is not None

    def to_dict(self) -> dict:
        return {"edge": self.edge, "rule": self.rule, "reason": self.reason,
                "spec": None if self.spec is None else self.spec.to_dict(),
                "constraint": None if self.constraint is None else self.constraint.to_dict(),
                "fused_into": self.fused_into,
                "alternative": None if self.alternative is None else self.alternative.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "EdgePlan":
        return cls(edge=d["edge"], rule=d["rule"], reason=d["reason"], spec=_spec_or_none(d["spec"]),
                   constraint=constraint_from_dict(d.get("constraint")), fused_into=d.get("fused_into"),
                   alternative=_spec_or_none(d.get("alternative")))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """A traced graph with a decision for every op, weight and edge."""

    graph: Graph
    rules: tuple[Rule, ...]
    ops: dict[str, OpPlan]
    edges: dict[str, EdgePlan]
    unmatched_rules: tuple[int, ...] = ()
    # The targets whose constraints are resolved into the edges, by name, and
    # their tables (to plan the same graph again; not serialized).
    targets: tuple[str, ...] = ()
    target_tables: tuple[Target, ...] = dataclasses.field(default=(), compare=False, repr=False)
    # (input edge, output edge): an output the caller feeds back as that input
    # at the next call (a KV cache), one qtype and one scale (`odmlq.plan._state`).
    state: tuple[tuple[str, str], ...] = ()

    @property
    def float_ops(self) -> tuple[str, ...]:
        """Ops that no rule matched (or that a skip rule kept in float)."""
        return tuple(
            o.id for o in self.graph.ops
            if o.kind != "scan"
            if self.ops[o.id].rule is None or self.ops[o.id].skip
        )

    def edge_spec(self, edge_id: str) -> QuantSpec | None:
        return self.edges[edge_id].spec

    @functools.cached_property
    def conversions(self) -> dict:
        """``(edge id, qtype) -> Conversion``: inputs an op reads in its own
        activation qtype, requantized from the edge's (see `odmlq.plan._conversions`)."""
        from odmlq.plan._conversions import input_conversions

        return input_conversions(self)

    @functools.cached_property
    def balanced_sums(self) -> tuple:
        """Sums whose two quantized operands trade per-channel offsets through
        their folded biases (`odmlq.plan._balance.BalancedSum`)."""
        from odmlq.plan._balance import balanced_sums

        return balanced_sums(self)

    def weight_specs(self) -> dict[str, QuantSpec]:
        """Parameter path -> the spec the plan gives it (quantized weights only).

        Raises:
          PlanError: two ops give one parameter two different specs.
        """
        specs: dict[str, QuantSpec] = {}
        for op_plan in self.ops.values():
            for w in op_plan.weights:
                if w.spec is None:
                    continue
                if w.param in specs and specs[w.param] != w.spec:
                    raise PlanError(
                        f"Parameter {w.param!r} is used by several ops with different specs "
                        f"({specs[w.param].describe()} vs {w.spec.describe()} at op {op_plan.op!r}); "
                        "give those ops one rule.")
                specs[w.param] = w.spec
        return specs

    def replan(self, rules: Sequence[Rule] | Rule) -> "Plan":
        """The same graph planned with other rules, for the same targets.

        Raises:
          PlanError: the plan was read from JSON, which names its targets
            but does not hold their tables.
        """
        if len(self.target_tables) != len(self.targets):
            raise PlanError(
                f"This plan was read from JSON: it names its targets {list(self.targets)} but does not "
                "hold their constraint tables; plan again with odmlq.plan(model, rules, x, target=...).")
        return plan_graph(self.graph, rules, self.target_tables, state=self.state)

    @property
    def state_indices(self) -> dict[int, int]:
        """`state` as ``{input index: output index}``, as `plan` takes it."""
        return state_indices(self.graph, self.state)

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps({
            "format": "odmlq.plan", "version": PLAN_FORMAT_VERSION, "targets": list(self.targets),
            "graph": self.graph.to_dict(), "rules": rules_to_dicts(self.rules),
            "ops": [o.to_dict() for o in self.ops.values()],
            "edges": [e.to_dict() for e in self.edges.values()],
            "unmatched_rules": list(self.unmatched_rules),
            **({"state": [list(pair) for pair in self.state]} if self.state else {}),
        }, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"Not a plan: JSON error at line {e.lineno}: {e.msg}.") from None
        if not isinstance(d, dict) or d.get("format") != "odmlq.plan":
            raise PlanError("Not an odmlq plan (no 'format': 'odmlq.plan' field).")
        if d.get("version") != PLAN_FORMAT_VERSION:
            raise PlanError(
                f"Plan format version {d.get('version')!r} is not supported (this odmlq "
                f"reads version {PLAN_FORMAT_VERSION}); re-create the plan with odmlq.plan()."
            )
        return cls(
            graph=Graph.from_dict(d["graph"]),
            rules=tuple(rules_from_dicts(d["rules"], source="plan")),
            ops={o["op"]: OpPlan.from_dict(o) for o in d["ops"]},
            edges={e["edge"]: EdgePlan.from_dict(e) for e in d["edges"]},
            unmatched_rules=tuple(d["unmatched_rules"]), targets=tuple(d.get("targets", ())),
            state=tuple(tuple(pair) for pair in d.get("state", ())),
        )

    def __str__(self) -> str:
        from odmlq.plan import _table as _plan_table

        return _plan_table.render(self)


def plan(model: Any, rules: Sequence[Rule] | Rule, *example_inputs: Any,
         variables: Any = None, method: Any = None, target: Target | Sequence[Target] = (),
         state: Mapping[int, int] | None = None) -> Plan:
    """Traces `model` and decides how every op, weight and edge is quantized.

    Args:
      model: a Linen module, an NNX module, or ``fn(params, *inputs)``.
      rules: rules in priority order (first match wins).
      *example_inputs: arrays or `jax.ShapeDtypeStruct`s as the model sees them.
      variables: Linen variables (optional: shapes are enough to plan), or
        the params of a plain function.
      method: Linen method / NNX method name to trace (default: call).
      target: the `odmlq.constraints.Target`s the plan must hold on (each
        backend has one: ``odmlq.litert.TARGET``, ``odmlq.xla.TARGET``; the
        face's ``odmlq.plan`` takes their names). Their scale constraints are
        resolved into the edges. None given: every scale is free.
      state: ``{input index: output index}`` among the model's arguments and
        returned items: an output the caller feeds back as that input at the
        next call (a decoder's KV cache; a pytree is paired leaf by leaf). Each pair keeps one qtype and one scale;
        on XLA a quantized state crosses calls as a `QArray`.

    Returns:
      The Plan. Rules that matched nothing are listed in
      `plan.unmatched_rules` and warned about (`UnmatchedRuleWarning`).

    Example:
      >>> p = odmlq.plan(model, [odmlq.Rule('.*', weight_qtype='int8', act_qtype='int8')], x)
      >>> print(p)
    """
    rules = check_rules(rules)
    graph = trace(model, *example_inputs, variables=variables, method=method)
    return plan_graph(graph, rules, target, state=state)


def check_rules(rules) -> tuple[Rule, ...]:
    if isinstance(rules, Rule):
        rules = [rules]
    if isinstance(rules, (str, bytes)) or not hasattr(rules, "__iter__"):
        raise RuleError(f"rules is a {type(rules).__name__} ({rules!r}), not a list of odmlq.Rule; write e.g. "
                        "[odmlq.Rule('.*', weight_qtype='int8', act_qtype='int8')], or read a rules file "
                        "with odmlq.load_rules(path).")
    rules = tuple(rules)
    for i, r in enumerate(rules):
        if not isinstance(r, Rule):
            raise RuleError(f"rules[{i}] is a {type(r).__name__}, not an odmlq.Rule: {r!r}.")
    return rules


def plan_graph(graph: Graph, rules: Sequence[Rule], target: Target | Sequence[Target] = (),
               state: Mapping[int, int] | None = None) -> Plan:
    """Applies `rules` to an already traced graph, for `target` (`state`: see `plan`)."""
    rules = check_rules(rules)
    pairs = state_pairs(graph, state)
    targets = (target,) if isinstance(target, Target) else tuple(target)
    for i, t in enumerate(targets):
        if not isinstance(t, Target):
            raise PlanError(f"target[{i}] is {t!r}, not an odmlq.constraints.Target; name targets "
                            "('litert', 'xla', 'both') through odmlq.plan, or pass odmlq.litert.TARGET.")
    op_plans: dict[str, OpPlan] = {}
    matched: set[int] = set()
    need_weight = any(t.dynamic_inputs_need_weight for t in targets)
    rows = any(t.dynamic_inputs_per_row for t in targets)
    float_kinds = frozenset().union(*(t.float_kinds for t in targets))
    for op in graph.ops:
        index = None
        if op.kind != "scan":
            writes = op.id in graph.output_writers
            index = next((i for i, r in enumerate(rules) if r.matches(op.module_path, op.kind, writes)), None)
        if index is not None:
            matched.add(index)
        rule = rules[index] if index is not None else None
        weights, constants = _weight_plans(op, rule, index, targets, graph.params), constant_specs(op, rule)
        quantized_constant = any(w.role == "weight" and w.spec is not None for w in weights) or any(
            c is not None for c in constants)
        op_plans[op.id] = OpPlan(op=op.id, rule=index, weights=weights, constants=constants,
                                 skip=rule is not None and rule.skip,
                                 dynamic_input=dynamic_input_spec(op, rule, rows),
                                 dynamic_inputs_float=need_weight and op.kind in MATMUL_KINDS
                                 and not quantized_constant,
                                 inputs_float=rule is not None and not rule.skip and op.kind in float_kinds)
    share_weight_specs(op_plans)
    op_plans = float_activations(graph, rules, op_plans, constraints := combine_targets(targets))
    float_outputs = float_output_ops(graph, rules, op_plans, rows=rows, is_depthwise=_depthwise,
                                     depthwise_float=any(t.dynamic_depthwise_float for t in targets))
    for op_id, spec in float_outputs.items():
        if spec is not None:
            op_plans[op_id] = dataclasses.replace(op_plans[op_id], dynamic_input=spec)
    from_integers = float_from_integers(graph, op_plans)
    carrier = next((t.float_input_carrier for t in targets if t.float_input_carrier), None)
    edge_plans = _edge_plans(graph, rules, op_plans, constraints, rows=rows, carrier=carrier,
                             from_integers=from_integers, float_outputs=frozenset(float_outputs))
    check_state_specs(graph, edge_plans, pairs)
    return Plan(graph=graph, rules=rules, ops=op_plans, edges=edge_plans,
                unmatched_rules=tuple(warn_unmatched(rules, matched)), targets=tuple(t.name for t in targets),
                target_tables=targets, state=pairs)


_DEPTHWISE_NOTE = ("float: a dynamic-range depthwise convolution runs outside XNNPACK on LiteRT, slower than "
                   "the float kernel XNNPACK runs")


def _depthwise(op: Op) -> bool:
    """A convolution that reads one input feature per group (LiteRT's DEPTHWISE_CONV_2D)."""
    weight = next((o for o in op.weights if o.role == "weight"), None)
    return (op.kind == "conv" and weight is not None and bool(weight.contraction_axes)
            and len(weight.contraction_axes) == 1 and weight.shape[weight.contraction_axes[0]] == 1)


def _weight_plans(op: Op, rule: Rule | None, index: int | None, targets: Sequence[Target] = (),
                  params: Mapping[str, tuple] | None = None) -> tuple[WeightPlan, ...]:
    """Each weight's plan under `rule`, within what every target can store and run."""
    limits = [t.weight_channel_axes for t in targets if t.weight_channel_axes is not None]
    channel_axes_limit = min(limits) if limits else None
    block_scale_dtype = next((t.block_scale_dtype for t in targets if t.block_scale_dtype), None)
    depthwise_float = any(t.dynamic_depthwise_float for t in targets) and _depthwise(op)
    out = []
    quantized = rule is not None and not rule.skip and rule.weight_qtype is not None
    read_as = constant_operand_spec(op, rule)
    for operand in op.weights:
        if not quantized:
            out.append(WeightPlan(param=operand.param, role=operand.role, spec=None))
        elif operand.role == "bias" and op.kind in MATMUL_KINDS:
            out.append(WeightPlan(
                param=operand.param, role="bias", spec=None,
                note="int32, scale = input scale x weight scale (derived by the backend)"))
        elif not operand.dtype.startswith(("float", "bfloat")):
            out.append(WeightPlan(param=operand.param, role=operand.role, spec=None,
                                  note=f"{operand.dtype}: not a float weight"))
        elif operand.derived:
            note = ("float: computed from parameters by arithmetic, not stored as them" if read_as is None
                    else f"computed from parameters by arithmetic; read as {read_as.describe()} "
                         "(quantized from its own value where the op reads it, like a constant operand)")
            out.append(WeightPlan(param=operand.param, role=operand.role, spec=None, note=note,
                                  read_as=read_as))
        elif rule.act_dynamic and op.kind not in MATMUL_KINDS and op.kind != "gather":
            out.append(WeightPlan(param=operand.param, role=operand.role, spec=None,
                                  note="float: dynamic-range kernels quantize matmul, conv and embedding weights only"))
        elif rule.act_dynamic and depthwise_float and operand.role == "weight":
            out.append(WeightPlan(param=operand.param, role=operand.role, spec=None, note=_DEPTHWISE_NOTE))
        elif read_as is not None and read_as.qtype != rule.weight_qtype:
            # An integer elementwise kernel reads every operand in its own
            # qtype (an int16 MUL of an int8 weight does not convert).
            out.append(WeightPlan(
                param=operand.param, role=operand.role, spec=None, read_as=read_as,
                note=f"read as {read_as.describe()} where the op reads it, like a constant operand: an "
                     "elementwise integer kernel reads every operand in its activation qtype"))
        else:
            spec = weight_spec(op, operand, rule, index, channel_axes_limit,
                               param_shape=(params or {}).get(operand.param, (None,))[0])
            if spec.block_size is not None and block_scale_dtype is not None:
                spec = dataclasses.replace(spec, scale_dtype=block_scale_dtype)
            out.append(WeightPlan(param=operand.param, role=operand.role, spec=spec))
    kernel = next((o.param for o in op.weights if o.role == "weight"), None)
    for operand in op.folds:
        out.append(WeightPlan(param=operand.param, role="fold", spec=None,
                              note=f"folded into {kernel} and the bias (a per-channel scale or shift: an inference BatchNorm)"))
    return tuple(out)


def _edge_plans(graph: Graph, rules, op_plans, constraints, *, rows: bool = False,
                carrier: str | None = None, from_integers: set[str] = frozenset(),
                float_outputs: frozenset[str] = frozenset()) -> dict[str, EdgePlan]:
    by_edge: dict[str, EdgePlan] = {}
    for edge in graph.edges.values():
        if edge.alias is not None:
            continue
        if not edge.is_float:
            by_edge[edge.id] = EdgePlan(edge=edge.id, spec=None, rule=None,
                                        reason=f"{edge.dtype}: not a float tensor")
            continue
        if edge.is_input or edge.producer is None:  # a model input, a loop's carry (`graph._loops`)
            if not edge.consumers:
                by_edge[edge.id] = EdgePlan(edge=edge.id, spec=None, rule=None, reason="unused input")
                continue
            op_id, how = edge.consumers[0], f"first consumer {edge.consumers[0]}"
        else:
            op_id, how = edge.producer, "producer"
        index = op_plans[op_id].rule
        rule = rules[index] if index is not None else None
        if rule is None:
            by_edge[edge.id] = EdgePlan(edge=edge.id, spec=None, rule=None, reason=f"no rule ({how})")
        elif op_id in from_integers:
            by_edge[edge.id] = EdgePlan(edge=edge.id, spec=None, rule=index, reason=f"{FROM_INTEGERS} ({how})")
        elif rule.skip or op_plans[op_id].skip or rule.act_qtype is None:
            why = "skip" if rule.skip else "no act_qtype" if rule.act_qtype is None else FLOAT_ACTIVATION
            by_edge[edge.id] = EdgePlan(edge=edge.id, spec=None, rule=index, reason=f"{why} ({how})")
        else:
            by_edge[edge.id] = EdgePlan(edge=edge.id, spec=act_spec(edge, rule, index),
                                        rule=index, reason=how)
    calibrate_masks(graph, by_edge)
    calibrate_norms(graph, by_edge)
    fuse_activations(graph, by_edge, constraints)
    dynamic_only_into_kernels(graph, by_edge, {o for o, p in op_plans.items() if p.dynamic_inputs_float})
    if rows:
        dynamic_per_row(graph, by_edge)
    resolve_output_constraints(graph, by_edge, constraints)
    share_scale_of_activations_beside_others(graph, by_edge, constraints)
    if carrier is not None:
        carry_float_inputs(graph, by_edge, carrier)
    floated(graph, by_edge, float_outputs)
    for edge in graph.edges.values():
        if edge.alias is not None:
            target = graph.resolve(edge.id)
            base = by_edge[target]
            by_edge[edge.id] = dataclasses.replace(base, edge=edge.id, reason=f"alias of {target}")
    return {e: by_edge[e] for e in graph.edges}
