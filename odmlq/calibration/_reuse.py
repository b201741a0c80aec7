"""One calibration serving several plans of the same graph (internal).

A plan made again with other rules (a suggested fix, an autotune trial) keeps
its edge ids, so the statistics already observed serve it wherever they can
give the new spec's range: the same method, or statistics that hold what the
new method reads (a histogram for MSE, moving averages for
`MovingAverageMinMax`, the same kept axes). `reusable` says which edges must be
observed again.
"""

from __future__ import annotations

from collections.abc import Iterable

from odmlq.calibration._calibration import Calibration, channel_key
from odmlq.calibration._methods import FixedRange, MovingAverageMinMax
from odmlq.calibration._statistics import keeps_extremes

__all__ = ["calibrated_edges", "derivable", "needs_calibration", "reusable", "restricted"]


def derivable(method, stats, new_method, scale_axes) -> bool:
    """Whether `stats`, observed with `method`, give `new_method`'s range."""
    if isinstance(new_method, FixedRange):
        return True
    if isinstance(method, FixedRange) or tuple(stats.keep_axes) != tuple(scale_axes):
        return False
    if getattr(new_method, "needs_histogram", False) and stats.histogram is None:
        return False
    if keeps_extremes(new_method) and stats.top is None:
        return False
    return not (isinstance(new_method, MovingAverageMinMax) and stats.moving_min is None)


def calibrated_edges(plan) -> dict:
    """Edge id -> spec of every edge `calibrate` observes for `plan`."""
    edges = {e: p.spec for e, p in plan.edges.items()
             if p.spec is not None and not p.spec.dynamic and plan.graph.edges[e].alias is None}
    for conversion in plan.conversions.values():
        # A float edge read by an integer op (after a float island) is
        # quantized where it is read: its range is calibrated too.
        edges.setdefault(conversion.edge, conversion.spec)
    for e, p in plan.edges.items():
        # A float output's static alternative (`EdgePlan.alternative`): its range
        # decides whether the output stays float (`odmlq.compute_scales`).
        if p.spec is None and getattr(p, "alternative", None) is not None and plan.graph.edges[e].alias is None:
            edges.setdefault(e, p.alternative)
    return edges


def needs_calibration(plan) -> bool:
    """Whether `plan` reads calibration statistics: edges it calibrates, or
    weights rounded against their inputs (`odmlq.GPTQ`, the default where
    calibration data reaches a weight, dynamic-range and weight-only plans
    included)."""
    return bool(calibrated_edges(plan)) or any(
        spec.algorithm is not None for spec in plan.weight_specs().values())


def reusable(calibration: Calibration, plan, edges: Iterable[str] | None = None) -> tuple[Calibration, list[str]]:
    """`calibration` as `plan` reads it, and the edges it cannot serve.

    Each edge (of `edges`, default all that `plan` calibrates) whose
    statistics give its spec's range is entered with the spec's method; the
    rest are returned to be observed again (`calibrate` on `restricted(plan,
    need)`). Weights' input moments (grams) and balanced sums' per-channel
    statistics are kept as they are; a balanced sum's missing ones are named
    by their edge."""
    entries = dict(calibration)
    need = []
    wanted = calibrated_edges(plan)
    for edge_id in (wanted if edges is None else [e for e in edges if e in wanted]):
        spec = wanted[edge_id]
        if edge_id not in entries:
            need.append(edge_id)
            continue
        method, stats = entries[edge_id]
        if method == spec.calibration:
            continue
        if derivable(method, stats, spec.calibration, spec.scale_axes):
            entries[edge_id] = (spec.calibration, stats)
        else:
            need.append(edge_id)
    for balanced in plan.balanced_sums:
        need += [e for e in balanced.edges if channel_key(e) not in entries and e not in need]
    return Calibration(entries, calibration.grams), need


def restricted(plan, edges: Iterable[str]):
    """`plan` with only `edges` quantized, to observe them alone (weights as planned)."""
    import dataclasses

    keep = set(edges)
    only = {e: p if e in keep else dataclasses.replace(p, spec=None) for e, p in plan.edges.items()}
    return dataclasses.replace(plan, edges=only)
