"""The shifts that balance a sum's per-channel offsets (internal; see
`odmlq.plan._balance` for which sums qualify and why).

For ``s = a + b`` (``b`` taken with the sum's sign), channel ``c`` of ``a``
spans ``[la_c, ha_c]`` and of ``b`` ``[lb_c, hb_c]`` in calibration. Shifting
``a`` by ``+d_c`` and ``b`` by ``-d_c`` keeps ``s``; the per-tensor ranges
``[La, Ha]`` and ``[Lb, Hb]`` can hold every channel iff widths cover each
channel's (``Wa >= max(ha - la)``, ``Wb >= max(hb - lb)``) and, per channel,
``La + Lb <= la_c + lb_c`` and ``Ha + Hb >= ha_c + hb_c``: so ``Wa + Wb`` is at
least the span of the per-channel bounds of the sum. Within that, the sum
of the two squared steps, the noise both edges add to ``s``, is smallest with
the widths in proportion to their levels squared; the split of ``La + Lb`` is
chosen so that both ranges hold zero where they can (a zero point must be on
the grid), and each ``d_c`` is the middle of what its channel allows. Each
channel's interval is first widened a little (`_MARGIN`).

A shift is kept only where the two edges' steps, zero included as the
quantizer does, come out smaller than without it.
"""

from __future__ import annotations

import numpy as np

from odmlq.calibration import Statistics, channel_key, compute_range
from odmlq.qtypes import qtype as lookup_qtype
from odmlq.qarray import scale_shape
from odmlq.scales._tensor import tensor_scale

__all__ = ["balance_shifts"]

# Each channel's calibrated interval is widened by this fraction of its width
# on both sides before the ranges are fitted. Balancing brings many channels
# to the edges of the per-tensor range where one channel was before, and a
# channel's extremes in calibration are not its extremes on other inputs:
# without room, held-out images clipped on a 128-channel edge seen 64 times
# per channel (transformers' Flax ResNet) and the gain became a loss.
_MARGIN = 0.05
# A shift must shrink the two edges' summed squared steps by this much.
_MIN_GAIN = 0.98


def balance_shifts(plan, calibration) -> tuple[dict[str, np.ndarray], dict[str, tuple[float, float]]]:
    """``(shifts, ranges)``: op id -> per-channel shift of its output (added to
    its folded bias), and edge id -> its calibrated range after the shift
    (the edge's own calibration method on the statistics the shifted tensor
    has: `shifted_statistics`)."""
    shifts: dict[str, np.ndarray] = {}
    ranges: dict[str, tuple[float, float]] = {}
    if calibration is None:
        return shifts, ranges
    for balanced in plan.balanced_sums:
        keys = [channel_key(e) for e in balanced.edges]
        if not all(k in calibration for k in keys) or any(e in ranges for e in balanced.edges):
            continue
        specs = [plan.edges[e].spec for e in balanced.edges]
        stats = [calibration[k][1] for k in keys]
        (la, ha), (lb, hb) = [(np.asarray(st.min, np.float64).reshape(-1), np.asarray(st.max, np.float64).reshape(-1))
                              for st in stats]
        if la.shape != lb.shape:
            continue
        if balanced.sign < 0:  # a - b = a + (-b)
            lb, hb = -hb, -lb
        la, ha = la - _MARGIN * (ha - la), ha + _MARGIN * (ha - la)
        lb, hb = lb - _MARGIN * (hb - lb), hb + _MARGIN * (hb - lb)
        d = _shifts(la, ha, lb, hb, [lookup_qtype(s.qtype) for s in specs])
        if d is None:
            continue
        moved = (d, -balanced.sign * d)
        before = [tuple(float(np.asarray(v).reshape(-1)[0]) for v in
                        calibration.range(e, s.qtype, symmetric=s.symmetric)) for e, s in zip(balanced.edges, specs)]
        shifted = [tuple(float(np.asarray(v).reshape(-1)[0]) for v in
                         compute_range(s.calibration, shifted_statistics(st, m), s.qtype, symmetric=s.symmetric))
                   for s, st, m in zip(specs, stats, moved)]
        if _cost(plan, balanced.edges, shifted) >= _MIN_GAIN * _cost(plan, balanced.edges, before):
            continue
        shifts[balanced.ops[0]], shifts[balanced.ops[1]] = (m.astype(np.float32) for m in moved)
        ranges.update(zip(balanced.edges, shifted))
    return shifts, ranges


def shifted_statistics(stats: Statistics, shift: np.ndarray) -> Statistics:
    """Per-tensor statistics of a tensor whose channel ``c`` (`stats` are kept
    per channel) is moved by ``shift[c]``: exact for counts, extremes and the
    most extreme values, sums up to float64 rounding."""
    d = np.asarray(shift, np.float64).reshape(-1)
    n = np.asarray(stats.count, np.float64)
    top = bottom = None
    if stats.top is not None:
        k = stats.top.shape[-1]
        top = -np.sort(-(stats.top + d[:, None]).reshape(-1))[:k]
        bottom = np.sort((stats.bottom + d[:, None]).reshape(-1))[:k]
    return Statistics(
        count=np.asarray(stats.count * d.size, np.int64),
        min=np.asarray(np.min(stats.min + d)), max=np.asarray(np.max(stats.max + d)),
        sum=np.asarray(np.sum(stats.sum + n * d)),
        sum_of_squares=np.asarray(np.sum(stats.sum_of_squares + 2 * d * stats.sum + n * d * d)),
        batches=stats.batches, top=top, bottom=bottom)


def _shifts(la, ha, lb, hb, qtypes) -> np.ndarray | None:
    levels = [float(q.qmax - q.qmin) for q in qtypes]
    wa_min, wb_min = float(np.max(ha - la)), float(np.max(hb - lb))
    low, high = float(np.min(la + lb)), float(np.max(ha + hb))
    span = high - low
    wa = max(wa_min, span * levels[0] ** 2 / (levels[0] ** 2 + levels[1] ** 2))
    wb = max(wb_min, span - wa)
    wa = max(wa_min, span - wb)
    # La + Lb = low; both ranges hold zero when La in [-wa, 0] and Lb = low - La in [-wb, 0].
    first, last = max(-wa, low), min(0.0, low + wb)
    la_total = (first + last) / 2 if first <= last else float(np.min(la))
    lb_total = low - la_total
    lo = np.maximum(la_total - la, hb - (lb_total + wb))
    hi = np.minimum(la_total + wa - ha, lb - lb_total)
    if np.any(lo > hi + 1e-6 * max(1.0, span)):
        return None
    return (lo + hi) / 2


def _cost(plan, edges, ranges) -> float:
    """The two edges' squared steps with these ranges, as the quantizer sets them."""
    total = 0.0
    for edge_id, (lo, hi) in zip(edges, ranges):
        spec = plan.edges[edge_id].spec
        shape = scale_shape(plan.graph.edges[edge_id].shape, ())
        total += float(np.max(tensor_scale(spec, lo, hi, shape).scale)) ** 2
    return total
