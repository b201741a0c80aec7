"""Advice: rule changes for the edges that lose accuracy themselves (internal).

`propose` looks at the edges that alone carry most of the outputs' error
(measured with only that edge quantized, `candidates`), costliest first,
and at those whose *local* SQNR (the error the edge introduces) is under
`ADVICE_BELOW_DB`, or `ADVICE_MARGIN_DB` under the median edge's, and
suggests for each one the module that decides it (its producer; a model
input's first consumer); an edge that costs the outputs next to nothing
gets none, whatever its local SQNR:

- another calibration method when the range explains the error: `MinMax()`
  when float values clip (the range is narrower than the data), and
  `Percentile(99.99)` (or `MSE()` if it already is) when the error is
  rounding on a range set by rare large values (peak / RMS of the float
  tensor at least `HEAVY_TAIL`);
- int16 activations (int16x8, int8 weights) when the error is rounding,
  not clipping, and the target can run it (a .tflite target: LiteRT's
  `check_plan` must accept the plan);
- per-channel weights when the op's weight is per tensor and has outlier
  channels;
- keeping the module in float (``skip=True``): what quantizing it costs at most.

Each suggestion is an `odmlq.Rule` matching the module path exactly
(``re.escape``) to be put before the plan's rules. `measure` (in
`_report_fixes`) re-plans with it and measures the gain.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings

import numpy as np

from odmlq.calibration import MSE, Capped, FixedRange, Masked, MinMax, Percentile
from odmlq.errors import OdmlqError
from odmlq.granularity import PerChannel
from odmlq.rules import Rule, UnmatchedRuleWarning

ADVICE_BELOW_DB = 30.0  # an edge introducing more error than this is worth a fix
ADVICE_MARGIN_DB = 10.0  # ... and so is one this far under the median edge
CLIPPED = 1e-3  # clipping explains the error when this share of values clip
HEAVY_TAIL = 8.0  # peak / RMS: a Gaussian's is about 4 on these sizes
# An edge that alone leaves the outputs within this of the whole model's SQNR
# carries most of their error: worth a fix ...
CONTRIBUTION_DB = 3.0
# ... and one that alone leaves them this far above costs them under 1%: not,
# whatever its local SQNR (a masked score's sentinel region).
NEGLIGIBLE_DB = 20.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measured:
    """What a suggested rule gives, measured on the report's inputs.

    Attributes:
      output_sqnr_db: the model's outputs vs float with `simulate` (the
        lowest over outputs).
      gain_db: `output_sqnr_db` minus the same measure without the rule.
      size_bytes, size_delta_bytes: of the re-exported .tflite, and its
        difference from the compared one (None without a .tflite).
      litert_output_sqnr_db: the re-exported model's outputs vs float.
    """

    output_sqnr_db: float
    gain_db: float
    size_bytes: int | None = None
    size_delta_bytes: int | None = None
    litert_output_sqnr_db: float | None = None

    def to_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isinf(v) else v)
                for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> "Measured":
        inf = lambda v: math.inf if v is None else float(v)  # noqa: E731
        return cls(output_sqnr_db=inf(d["output_sqnr_db"]), gain_db=inf(d["gain_db"]),
                   size_bytes=d.get("size_bytes"), size_delta_bytes=d.get("size_delta_bytes"),
                   litert_output_sqnr_db=(None if d.get("litert_output_sqnr_db") is None
                                          else float(d["litert_output_sqnr_db"])))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Advice:
    """One suggested rule for one edge, and what it measured (None: not tried).

    Put `rule` first in the rules: ``[advice.rule, *plan.rules]``.
    """

    edge: str
    module_path: str
    change: str
    rule: Rule
    why: str
    measured: Measured | None = None

    def to_dict(self) -> dict:
        return {"edge": self.edge, "module_path": self.module_path, "change": self.change,
                "rule": self.rule.to_dict(), "why": self.why,
                "measured": None if self.measured is None else self.measured.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "Advice":
        return cls(edge=d["edge"], module_path=d["module_path"], change=d["change"],
                   rule=Rule.from_dict(d["rule"]), why=d["why"],
                   measured=None if d.get("measured") is None else Measured.from_dict(d["measured"]))


def deciding_op(plan, edge_id: str):
    """The op whose rule decides an edge: its producer, or a model input's first consumer."""
    edge = plan.graph.edges[edge_id]
    op_id = edge.producer or (edge.consumers[0] if edge.consumers else None)
    return None if op_id is None else plan.graph.op(op_id)


def candidates(edges, limit: int, output_sqnr_db: float = math.inf) -> list:
    """The edges to advise on, costliest for the outputs first: those clearly
    worse than the rest by local SQNR, and, where the outputs are under
    `ADVICE_BELOW_DB` (`output_sqnr_db`; a healthy model's largest noise
    source is no fault), those that alone cost the outputs as much as
    everything together bar `CONTRIBUTION_DB` (`EdgeReport.alone_sqnr_db`);
    never one that alone leaves the outputs `NEGLIGIBLE_DB` above theirs."""
    local = [e for e in edges if e.spec != "float" and "local" in e.runs
             and math.isfinite(e.runs["local"].sqnr_db)]
    if not local:
        return []
    median = float(np.median([e.runs["local"].sqnr_db for e in local]))

    def alone(e) -> float:
        return math.inf if e.alone_sqnr_db is None else e.alone_sqnr_db

    # Under the threshold, or under the median by the margin: x < max(a, b) is x < a or x < b.
    bad = [e for e in local if e.runs["local"].sqnr_db < max(ADVICE_BELOW_DB, median - ADVICE_MARGIN_DB)
           or (output_sqnr_db < ADVICE_BELOW_DB and alone(e) <= output_sqnr_db + CONTRIBUTION_DB)]
    bad = [e for e in bad if e.alone_sqnr_db is None or alone(e) < output_sqnr_db + NEGLIGIBLE_DB]
    return sorted(bad, key=lambda e: (alone(e), e.runs["local"].sqnr_db))[:limit]


def propose(plan, edges, *, weights=(), calibration=None, floats=None, litert: bool = False,
            allow_float_ops: bool = False, limit: int = 3,
            output_sqnr_db: float = math.inf) -> tuple[list[Advice], list[str]]:
    """Suggestions for the worst edges, and notes on what was not suggested and why.

    Args:
      plan: the compared Plan.
      edges: the report's `EdgeReport`s.
      weights: the report's `WeightRange`s (outlier channels).
      calibration: the statistics the scales came from (which method each edge holds).
      floats: edge id -> float tensor (for the heavy-tail test).
      litert: the target is LiteRT: only rules its `check_plan` accepts.
      allow_float_ops: the compared .tflite has float ops already (so may the new one).
      output_sqnr_db: the outputs' SQNR against float with simulate (lowest output).
    """
    advice, notes, seen = [], [], set()
    by_param = {w.param: w for w in weights}
    chosen = candidates(edges, limit, output_sqnr_db)
    if not chosen:
        for rule, why in _spread(plan, edges, output_sqnr_db):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UnmatchedRuleWarning)
                try:
                    new_plan = plan.replan((rule, *plan.rules))
                    if litert:
                        from odmlq.litert.export import check_plan

                        check_plan(new_plan, allow_float_ops=allow_float_ops)
                except OdmlqError as error:
                    notes.append(f"advice for every edge of {rule.module_path!r}: int16 activations not "
                                 f"suggested: {error}")
                    continue
            advice.append(Advice(edge="*", module_path=rule.module_path, change="act_qtype='int16' (int16x8), "
                                 "every edge the rule decides", rule=rule, why=why))
    for e in chosen:
        op = deciding_op(plan, e.edge)
        index = None if op is None else plan.ops[op.id].rule
        if index is None or plan.rules[index].skip or op.module_path in seen:
            continue
        seen.add(op.module_path)
        base, spec = plan.rules[index], plan.edges[e.edge].spec
        for change, rule, why in _suggestions(e, op, base, spec, plan, by_param, calibration, floats):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UnmatchedRuleWarning)
                try:
                    new_plan = plan.replan((rule, *plan.rules))
                    if litert:
                        from odmlq.litert.export import check_plan

                        check_plan(new_plan, allow_float_ops=rule.skip or allow_float_ops)
                except OdmlqError as error:
                    notes.append(f"advice for {e.edge!r}: {change} not suggested: {error}")
                    continue
            advice.append(Advice(edge=e.edge, module_path=op.module_path, change=change, rule=rule, why=why))
    return advice, notes


def int16_twin(base: Rule, **changes) -> Rule:
    """`base` with int16 activations and int8 weights (where it had weights):
    symmetric as int16 is, and without `float_outputs`, which is for int8
    edges (`odmlq.INT8` has it: its twin was refused by the Rule itself)."""
    return dataclasses.replace(base, act_qtype="int16", act_symmetric=None, float_outputs=False,
                               weight_qtype="int8" if base.weight_qtype is not None else None, **changes)


def _spread(plan, edges, output_sqnr_db: float):
    """(rule, why) for an error spread over many edges: where the outputs are
    under `ADVICE_BELOW_DB` and no edge alone carries their error (none is a
    `candidates`), what moves them is every edge at once. The int8 edges'
    rule whose edges alone cost the outputs most together gets its int16x8
    twin (same path and kinds, so put first it decides exactly the ops it
    did)."""
    if not output_sqnr_db < ADVICE_BELOW_DB:
        return []
    noise: dict[int, float] = {}
    lowest = math.inf
    for e in edges:
        spec = plan.edges[e.edge].spec if e.edge in plan.edges else None
        op = deciding_op(plan, e.edge)
        if e.alone_sqnr_db is None or spec is None or spec.dynamic or spec.qtype != "int8" or op is None:
            continue
        index = plan.ops[op.id].rule
        if index is None or plan.rules[index].skip:
            continue
        lowest = min(lowest, e.alone_sqnr_db)
        noise[index] = noise.get(index, 0.0) + 10 ** (-e.alone_sqnr_db / 10)
    if not noise:
        return []
    index = max(noise, key=noise.get)
    base = plan.rules[index]
    total = 10 ** (-output_sqnr_db / 10)
    rule = int16_twin(base)
    why = (f"the error is spread: no edge alone costs the outputs within {CONTRIBUTION_DB:g} dB of all "
           f"together ({output_sqnr_db:.1f} dB; the costliest alone leaves {lowest:.1f} dB); this rule's int8 "
           f"edges alone add up to {min(noise[index] / total, 1.0):.0%} of the error, and int16 steps are 256x finer")
    return [(rule, why)]


def _stored_method(edge_id, spec, calibration):
    if calibration is not None and edge_id in calibration:
        return calibration[edge_id][0]
    return spec.calibration


def _suggestions(e, op, base: Rule, spec, plan, by_param, calibration, floats):
    """(change, rule, why) for one edge, most specific first."""
    path = re.escape(op.module_path)
    local = e.runs["local"]
    clipped = local.clipped or 0.0
    out = []
    if spec is not None and not spec.dynamic:
        method = _stored_method(e.edge, spec, calibration)
        # (Masked and Capped clip on purpose: a mask's sentinel, a norm's zero-variance rows.)
        if clipped >= CLIPPED and not isinstance(method, (MinMax, Masked, Capped)):
            out.append(("act_calibration=MinMax()", dataclasses.replace(base, module_path=path, act_calibration=MinMax()),
                        f"{clipped:.1%} of the float values are clipped, outside the edge's range "
                        f"(calibrated with {_name(method)}); the full observed range keeps them"))
        peak = _peak_to_rms(None if floats is None else floats.get(e.edge))
        if clipped < CLIPPED and peak >= HEAVY_TAIL and not spec.scale_axes:
            new = MSE() if isinstance(method, Percentile) else Percentile(99.99)
            out.append((f"act_calibration={_name(new)}", dataclasses.replace(base, module_path=path, act_calibration=new),
                        f"the error is rounding on a range set by rare large values (peak {peak:.0f}x "
                        "the RMS); clipping them gives finer steps to the rest"))
        if clipped < CLIPPED and spec.qtype == "int8":
            out.append(("act_qtype='int16' (int16x8)", int16_twin(base, module_path=path),
                        f"the error is rounding (up to {local.lsb or 0:.1f} LSB); int16 steps are 256x finer"))
    for w in plan.ops[op.id].weights:
        found = by_param.get(w.param)
        if w.spec is not None and not w.spec.scale_axes and found is not None and found.outliers:
            out.append(("weight_granularity=PerChannel()",
                        dataclasses.replace(base, module_path=path, weight_granularity=PerChannel()),
                        f"{w.param} is per tensor and channels {list(found.outliers)[:5]} reach "
                        f"{found.outlier_ratio:.1f}x the median channel's abs max"))
            break
    out.append(("skip=True (keep in float)", Rule(path, base.op, skip=True),
                "the most this module can gain: none of its error, at float size and speed"))
    return out


def _name(method) -> str:
    if isinstance(method, FixedRange):
        return f"FixedRange({method.min:g}, {method.max:g})"
    return repr(method).replace("percentile=", "")


def _peak_to_rms(x) -> float:
    if x is None:
        return 0.0
    x = np.asarray(x, np.float64)
    rms = float(np.sqrt(np.mean(x ** 2))) if x.size else 0.0
    return float(np.max(np.abs(x))) / rms if rms > 0 else 0.0
