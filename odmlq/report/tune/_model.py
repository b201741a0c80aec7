"""The model autotune works on: its candidate plans, groups, data and costs (internal)."""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from odmlq import litert, xla
from odmlq.calibration import Calibration, calibrate, restricted, reusable
from odmlq.errors import PlanError
from odmlq.graph import flat_params, params_for
from odmlq.litert.spec import sets_own_scale
from odmlq.plan import plan as make_plan
from odmlq.rules import Rule, UnmatchedRuleWarning
from odmlq.scales import compute_scales
from odmlq.qtypes import qtype as lookup_qtype
from odmlq.simulate import Simulator
from odmlq.report.tune._candidates import Candidate, group_pattern
from odmlq.report.tune._search import Boundaries

__all__ = ["TunedModel", "BACKENDS", "rules_for"]

BACKENDS = {"litert": (litert.TARGET,), "xla": (xla.TARGET,), "both": (xla.TARGET, litert.TARGET)}


class TunedModel:
    """A traced model with its candidate plans, the groups rules can address,
    a calibration serving every plan, and the float reference."""

    def __init__(self, model: Any, variables: Any, batches: list[tuple], eval_batches: list[tuple],
                 candidates: Sequence[Candidate], backend: str, calibration: Calibration | None,
                 example_inputs: tuple):
        self.model, self.variables, self.backend = model, variables, backend
        self.batches, self.eval_batches = batches, eval_batches
        self.candidates = tuple(candidates)
        self.params = params_for(model, variables, "autotune")
        first = next((c for c in candidates if not c.is_float), candidates[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnmatchedRuleWarning)
            base = make_plan(model, [first.rule()], *example_inputs, variables=variables,
                             target=BACKENDS[backend])
            self.plans = [base.replan([c.rule()]) for c in candidates]
            self.float_plan = base.replan([])
        self.base = base
        self.graph = base.graph
        self.notes: list[str] = []
        op_legal = self._op_legality()
        self.groups, self.selectors, self.op_group = self._groups(op_legal)
        self.legal = self._legal(op_legal)
        self._calibrations: list[Calibration] = [] if calibration is None else [calibration]
        self._float = Simulator(model, self.float_plan, compute_scales(self.float_plan, None, self.params),
                                variables=variables)
        self.reference = [[np.asarray(o) for o in _leaves(self._float(*b))] for b in eval_batches]

    # -- groups and legality ------------------------------------------------
    def _op_legality(self) -> dict[str, np.ndarray]:
        """Op id -> (candidates,) bool: whether the backend runs the op as the
        candidate says, for every op some candidate quantizes (a weight or an
        output). A candidate the backend refuses outright is legal nowhere."""
        quantized = [op for op in self.graph.ops if any(_quantizes(p, op) for p in self.plans)]
        legal = {op.id: np.ones(len(self.candidates), bool) for op in quantized}
        if self.backend == "xla":
            return legal
        for c, (candidate, plan) in enumerate(zip(self.candidates, self.plans)):
            if candidate.is_float:
                continue
            try:
                float_ops = set(litert.check_plan(plan, allow_float_ops=True))
            except PlanError as e:
                float_ops = set(legal)
                self.notes.append(f"candidate {candidate.name!r} is not offered: LiteRT refuses it ({e})")
            for op_id in float_ops & set(legal):
                legal[op_id][c] = False
        return legal

    def _groups(self, op_legal: dict[str, np.ndarray]) -> tuple[list[str], list[tuple[str, tuple | None]],
                                                                dict[str, int]]:
        """The groups rules address, in op order: (names, selectors, op id -> group).

        A group is the ops at one module path. Where the backend runs some of
        them at a candidate and not others (a block's residual ADD takes int16,
        its LOG does not), the path is split by op kind, so that one kind's
        limits do not hold back the others. A selector is (module path, op
        kinds or None for all)."""
        every: dict[str, list] = {}  # module path -> all its ops, quantized or not
        by_path: dict[str, list] = {}  # module path -> the ops some candidate quantizes, in op order
        for op in self.graph.ops:
            every.setdefault(op.module_path, []).append(op)
            if op.id in op_legal:
                by_path.setdefault(op.module_path, []).append(op)
        names, selectors, op_group = [], [], {}
        for path, ops in by_path.items():
            all_ops = every[path]
            mixed = len({op_legal[op.id].tobytes() for op in ops}) > 1
            kinds = list(dict.fromkeys(op.kind for op in ops)) if mixed else [None]
            for kind in kinds:
                op_group.update({op.id: len(names) for op in all_ops if kind is None or op.kind == kind})
                names.append(path if kind is None else f"{path} [{kind}]")
                selectors.append((path, None if kind is None else (kind,)))
        return names, selectors, op_group

    def _legal(self, op_legal: dict[str, np.ndarray]) -> np.ndarray:
        """(candidates, groups): whether the backend runs every op of the group as the candidate says."""
        legal = np.ones((len(self.candidates), len(self.groups)), bool)
        for op_id, ok in op_legal.items():
            legal[:, self.op_group[op_id]] &= ok
        stuck = [self.groups[g] for g in np.flatnonzero(~legal.any(axis=0))]
        if stuck and not any(c.is_float for c in self.candidates):
            raise PlanError(
                f"autotune: no candidate runs the ops at {stuck[:5]} on LiteRT (each would leave an "
                "op in float); add the 'float' candidate, or tune for backend='xla'.")
        return legal

    # -- calibration --------------------------------------------------------
    def calibration_for(self, plan) -> Calibration:
        """Statistics for `plan`: each edge's from the first calibration held
        that gives its method's range (candidates may calibrate one edge with
        different methods: MSE's histogram, MinMax(headroom=True)'s extremes),
        and any it still needs observed now and held too."""
        if not self._calibrations:
            static = next((p for p, c in zip(self.plans, self.candidates) if not c.is_float), self.plans[0])
            self._calibrations.append(calibrate(self.model, static, self.batches, variables=self.variables,
                                                progress=False))
        calibration, need = reusable(self._calibrations[0], plan)
        entries, grams = dict(calibration), dict(calibration.grams)
        for held in self._calibrations[1:]:
            if not need:
                break
            served, need_here = reusable(held, plan, need)
            entries.update({e: served[e] for e in need if e not in need_here and e in served})
            grams.update({k: v for k, v in held.grams.items() if k not in grams})
            need = need_here
        missing_grams = [p for p, spec in plan.weight_specs().items()
                         if spec.algorithm is not None and p not in grams]
        if need or missing_grams:
            fresh = calibrate(self.model, restricted(plan, need), self.batches, variables=self.variables,
                              progress=False)
            self._calibrations.append(fresh)
            entries.update({k: fresh[k] for k in fresh if k in need or k not in entries})
            grams.update({k: v for k, v in fresh.grams.items() if k not in grams})
        return Calibration(entries, grams)

    def scales(self, plan):
        return compute_scales(plan, self.calibration_for(plan), self.params)

    # -- costs --------------------------------------------------------------
    def costs(self) -> dict[str, np.ndarray | float]:
        """Per (candidate, group): `cost`, the bits a group moves per sample
        (its parameters and its output activations); `weight_bits` (its
        matmul/conv/elementwise weights) and `param_bits` (every parameter it
        owns), as stored. Also `weight_elements` and `fixed_bits` (parameters
        no group owns, float32)."""
        flat = flat_params(self.params)
        owner: dict[str, tuple[int, str]] = {}
        everything: dict[str, str] = {}
        for op in self.graph.ops:
            for operand in op.operands:
                if operand.param is None:
                    continue
                everything.setdefault(operand.param, operand.role)
                if op.id in self.op_group:
                    owner.setdefault(operand.param, (self.op_group[op.id], operand.role))
        elements = np.zeros(len(self.groups))
        for op in self.graph.ops:
            if op.id not in self.op_group:
                continue
            for edge_id in op.outputs:
                edge = self.graph.edges[edge_id]
                if edge.alias is None and edge.is_float:
                    elements[self.op_group[op.id]] += math.prod(edge.shape[1:]) if edge.shape else 1
        shape = (len(self.candidates), len(self.groups))
        weight_bits, param_bits = np.zeros(shape), np.zeros(shape)
        for c, plan in enumerate(self.plans):
            specs = plan.weight_specs()
            for param, (g, role) in owner.items():
                stored = weight_storage_bits(np.shape(flat[param]), specs.get(param))
                param_bits[c, g] += stored
                if role == "weight":
                    weight_bits[c, g] += stored
        act_bits = np.array([c.act_bits for c in self.candidates])[:, None]
        return {"cost": param_bits + elements[None, :] * act_bits, "weight_bits": weight_bits,
                "param_bits": param_bits,
                "boundaries": self.boundaries() if self.backend != "xla" else None,
                "weight_elements": float(sum(math.prod(np.shape(flat[p])) for p, r in everything.items()
                                             if r == "weight")),
                "fixed_bits": float(sum(32.0 * math.prod(np.shape(flat[p])) for p in everything
                                        if p not in owner))}

    def boundaries(self) -> Boundaries:
        """Where groups meet on LiteRT (`_search.Boundaries`): each edge one
        group writes and another group, an op no candidate quantizes or the
        model's caller reads (or the other way round). XLA has no
        conversions to count: its quantized ops read float edges and
        quantize them in the op."""
        names = list(dict.fromkeys(c.edge_qtype for c in self.candidates if c.edge_qtype is not None))
        domain = np.array([0 if c.edge_qtype is None else 1 + names.index(c.edge_qtype)
                           for c in self.candidates])
        bits = np.array([32.0] + [float(lookup_qtype(n).bits) for n in names])
        shared, separated = [], set()
        for edge in self.graph.edges.values():
            if edge.alias is not None or not edge.is_float:
                continue
            producer = self.op_group.get(edge.producer, -1) if edge.producer is not None else -1
            readers = {self.op_group.get(op_id, -1) for op_id in edge.consumers}
            readers |= {-1} if edge.is_output else set()
            if len(readers | {producer}) > 1:
                if producer >= 0:
                    separated |= {(len(shared), c)
                                  for c, (candidate, plan) in enumerate(zip(self.candidates, self.plans))
                                  if candidate.edge_qtype is not None
                                  and sets_own_scale(plan, edge.id, candidate.edge_qtype)}
                shared.append((float(math.prod(edge.shape[1:]) if edge.shape else 1), producer,
                               tuple(sorted(readers))))
        return Boundaries(domain=domain, domain_bits=bits, edges=tuple(shared), separated=frozenset(separated))

    def size(self, plan) -> tuple[int, float]:
        """(bytes of every parameter the graph reads, average bits per weight)."""
        flat = flat_params(self.params)
        specs = plan.weight_specs()
        total, weight_bits, weight_elements, seen = 0.0, 0.0, 0, set()
        for op in self.graph.ops:
            for operand in op.operands:
                if operand.param is None or operand.param in seen:
                    continue
                seen.add(operand.param)
                shape = np.shape(flat[operand.param])
                stored = weight_storage_bits(shape, specs.get(operand.param))
                total += stored
                if operand.role == "weight":
                    weight_bits += stored
                    weight_elements += math.prod(shape)
        return int(math.ceil(total / 8)), weight_bits / max(weight_elements, 1)

    def simulator(self, plan, scales) -> Simulator:
        return Simulator(self.model, plan, scales, variables=self.variables)

    def float_apply(self, *inputs):
        return self._float(*inputs)


def weight_storage_bits(shape: tuple, spec) -> float:
    """Bits a parameter takes stored as `spec` says: its values, and one
    float32 scale (and zero point) per channel or block; float32 without one."""
    elements = math.prod(shape)
    if spec is None:
        return 32.0 * elements
    scales = 1
    if spec.block_size is not None:
        scales = elements // spec.block_size
    for axis in spec.scale_axes:
        scales *= shape[axis] if axis < len(shape) else 1
    per_scale = 32 if spec.symmetric else 64
    return 8.0 / spec.qtype.values_per_byte * elements + per_scale * scales


def _quantizes(plan, op) -> bool:
    weights = any(w.spec is not None for w in plan.ops[op.id].weights)
    outputs = any(plan.edges[e].spec is not None for e in op.outputs if e in plan.edges)
    return weights or outputs


def _leaves(tree) -> list:
    import jax

    return jax.tree_util.tree_leaves(tree)


def rules_for(tuned: TunedModel, config) -> list[Rule]:
    """Rules giving each group its candidate: the commonest candidate as the
    last, catch-all rule, and one rule before it per pattern of the others
    (module paths that differ only in numbers share a rule when every group
    the pattern matches takes the same candidate). A group split by op kind
    gets a rule with that `op`."""
    names = [tuned.candidates[c] for c in config]
    common = Counter(c.name for c in names).most_common(1)[0][0]
    by_name = {c.name: c for c in tuned.candidates}
    rules, covered = [], set()
    for g, ((path, kinds), candidate) in enumerate(zip(tuned.selectors, names)):
        if candidate.name == common or g in covered:
            continue
        exact = group_pattern(path)
        general = re.sub(r"\d+", r"\\d+", exact)
        matched = [i for i, (p, k) in enumerate(tuned.selectors)
                   if re.fullmatch(general, p) and (k is None or kinds is None or set(k) & set(kinds))]
        if general != exact and all(names[i].name == candidate.name for i in matched):
            pattern = general
        else:
            pattern, matched = exact, [g]
        covered.update(matched)
        rules.append((pattern, kinds, candidate))
    merged: dict[tuple[str, str], list] = {}  # one rule per pattern and candidate, its op kinds together
    for pattern, kinds, candidate in rules:
        entry = merged.setdefault((pattern, candidate.name), [candidate, ()])
        entry[1] = None if kinds is None or entry[1] is None else entry[1] + kinds
    return ([candidate.rule(pattern, op=kinds) for (pattern, _), (candidate, kinds) in merged.items()]
            + [by_name[common].rule(".*")])
