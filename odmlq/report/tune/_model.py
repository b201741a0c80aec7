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
from odmlq.plan import plan as make_plan
from odmlq.rules import Rule, UnmatchedRuleWarning
from odmlq.scales import compute_scales
from odmlq.simulate import Simulator
from odmlq.report.tune._candidates import Candidate, group_pattern

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
        self.groups, self.op_group = self._groups()
        self.legal = self._legal()
        self._calibration = calibration
        self._float = Simulator(model, self.float_plan, compute_scales(self.float_plan, None, self.params),
                                variables=variables)
        self.reference = [[np.asarray(o) for o in _leaves(self._float(*b))] for b in eval_batches]

    # -- groups and legality ------------------------------------------------
    def _groups(self) -> tuple[list[str], dict[str, int]]:
        """Module paths of the ops some candidate quantizes (a weight or an output), in op order."""
        paths: list[str] = []
        for op in self.graph.ops:
            if any(_quantizes(p, op) for p in self.plans):
                if op.module_path not in paths:
                    paths.append(op.module_path)
        index = {p: i for i, p in enumerate(paths)}
        op_group = {op.id: index[op.module_path] for op in self.graph.ops if op.module_path in index}
        return paths, op_group

    def _legal(self) -> np.ndarray:
        """(candidates, groups): whether the backend runs every op of the group as the candidate says."""
        legal = np.ones((len(self.candidates), len(self.groups)), bool)
        if self.backend == "xla":
            return legal
        for c, (candidate, plan) in enumerate(zip(self.candidates, self.plans)):
            if candidate.is_float:
                continue
            try:
                float_ops = litert.check_plan(plan, allow_float_ops=True)
            except PlanError as e:
                legal[c] = False
                self.notes.append(f"candidate {candidate.name!r} is not offered: LiteRT refuses it ({e})")
                continue
            for op_id in float_ops:
                if op_id in self.op_group:
                    legal[c, self.op_group[op_id]] = False
        stuck = [self.groups[g] for g in np.flatnonzero(~legal.any(axis=0))]
        if stuck:
            floats = [c for c, cand in enumerate(self.candidates) if cand.is_float]
            if not floats:
                raise PlanError(
                    f"autotune: no candidate runs the ops at {stuck[:5]} on LiteRT (each would leave an "
                    "op in float); add the 'float' candidate, or tune for backend='xla'.")
        return legal

    # -- calibration --------------------------------------------------------
    def calibration_for(self, plan) -> Calibration:
        """Statistics for `plan`: the ones held, and any it needs observed now."""
        if self._calibration is None:
            static = next((p for p, c in zip(self.plans, self.candidates) if not c.is_float), self.plans[0])
            self._calibration = calibrate(self.model, static, self.batches, variables=self.variables,
                                          progress=False)
        calibration, need = reusable(self._calibration, plan)
        missing_grams = [p for p, spec in plan.weight_specs().items()
                         if spec.algorithm is not None and p not in calibration.grams]
        if need or missing_grams:
            fresh = calibrate(self.model, restricted(plan, need), self.batches, variables=self.variables,
                              progress=False)
            entries = dict(self._calibration)
            entries.update({k: fresh[k] for k in fresh if k not in entries})
            grams = {**fresh.grams, **self._calibration.grams}
            self._calibration = Calibration(entries, grams)
            calibration, need = reusable(self._calibration, plan)
        return calibration

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
                "weight_elements": float(sum(math.prod(np.shape(flat[p])) for p, r in everything.items()
                                             if r == "weight")),
                "fixed_bits": float(sum(32.0 * math.prod(np.shape(flat[p])) for p in everything
                                        if p not in owner))}

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
    the pattern matches takes the same candidate)."""
    names = [tuned.candidates[c] for c in config]
    common = Counter(c.name for c in names).most_common(1)[0][0]
    by_name = {c.name: c for c in tuned.candidates}
    rules, covered = [], set()
    for path, candidate in zip(tuned.groups, names):
        if candidate.name == common or path in covered:
            continue
        general = re.sub(r"\d+", r"\\d+", group_pattern(path))
        matched = [i for i, p in enumerate(tuned.groups) if re.fullmatch(general, p)]
        if general != group_pattern(path) and all(names[i].name == candidate.name for i in matched):
            pattern = general
        else:
            pattern, matched = group_pattern(path), [tuned.groups.index(path)]
        covered.update(tuned.groups[i] for i in matched)
        rules.append(candidate.rule(pattern))
    return rules + [by_name[common].rule(".*")]
