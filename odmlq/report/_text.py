"""A Report as text: the edge table, outputs, weights with outliers, advice, notes (internal)."""

from __future__ import annotations

import math

from odmlq.plan import named_list, text_table as table

BACKEND_RUNS = ("xla", "litert", "device")


def db(value: float) -> str:
    return "inf" if math.isinf(value) and value > 0 else "-inf" if math.isinf(value) else f"{value:.1f}"


def render(report) -> str:
    lines = []
    if report.edges:
        lines += _edges(report)
        lines += _contributors(report)
    if report.outputs:
        lines.append("outputs vs float: " + ", ".join(
            f"{k}: {db(m.sqnr_db)} dB" + (f" ({m.nan} NaN)" if m.nan else "") for k, m in report.outputs.items()))
    if report.unmapped_tensors:
        lines.append("LiteRT tensors with no plan edge: "
                     + named_list(report.unmapped_tensors, where="Report.unmapped_tensors"))
    lines += _weights(report.weights)
    lines += _float_ops(report.float_ops)
    lines += _advice(report.advice)
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)


def _edges(report) -> list[str]:
    runs = [r for r in report.runs if any(r in e.runs for e in report.edges)]
    backends = [r for r in runs if r in BACKEND_RUNS]
    headers = (["edge", "module", "spec"] + [f"{r} dB" for r in runs] + ["max LSB", "clipped", "NaN"]
               + [f"{r}-sim LSB" for r in backends] + ["who"])
    rows = []
    for e in report.edges:
        sim = e.runs.get("simulate")
        cells = [e.edge, e.module_path or "''", e.spec]
        cells += [db(e.runs[r].sqnr_db) if r in e.runs else "-" for r in runs]
        nan = sum(m.nan for m in e.runs.values())
        cells += [f"{sim.lsb:.1f}" if sim and sim.lsb is not None else "-",
                  f"{100 * sim.clipped:.2f}%" if sim and sim.clipped is not None else "-",
                  str(nan) if nan else "-"]
        cells += [f"{e.runs[r].simulate_lsb:.1f}" if r in e.runs and e.runs[r].simulate_lsb is not None
                  else "-" for r in backends]
        cells.append(e.who)
        rows.append(cells)
    return ["Edges, worst local SQNR first (local: this op on float inputs; simulate: "
            "everything quantized; vs float; edges sharing a scale together, the one whose "
            "range sets it first, the others 'shared')", table(headers, rows)]


def _contributors(report) -> list[str]:
    top = report.contributors()
    if not top:
        return []
    rows = [[e.edge, e.module_path or "''", e.spec, db(e.alone_sqnr_db), f"{e.float_gain_db:+.1f}",
             db(e.runs["local"].sqnr_db) if "local" in e.runs else "-"] for e in top]
    return ["Edges that cost the outputs most (outputs vs float with only that edge quantized; "
            "their gain with only that edge in float)",
            table(["edge", "module", "spec", "alone dB", "float gain dB", "local dB"], rows)]


def _weights(weights) -> list[str]:
    return _outliers(weights) + _collapsed(weights)


def _collapsed(weights) -> list[str]:
    flagged = [w for w in weights if w.collapsed]
    if not flagged:
        return []
    lines = [f"Weights with collapsed blocks or channels (over half of their nonzero weights round to 0; "
             f"a smaller block, per-channel scales or more bits keep them): {len(flagged)} of {len(weights)}"]
    for w in flagged:
        shown = ", ".join(map(str, w.collapsed[:8])) + (", ..." if len(w.collapsed) > 8 else "")
        lines.append(f"  {w.param} ({w.spec}): {len(w.collapsed)} of {w.cells} scale cells collapsed "
                     f"(flat index in the scale's shape: {shown})")
    return lines


def _outliers(weights) -> list[str]:
    flagged = [w for w in weights if w.outliers]
    if not flagged:
        return [f"weights: {len(weights)} quantized, no outlier channels (abs max > 4x the median channel's)"
                ] if weights else []
    lines = [f"Weights with outlier channels (abs max > 4x the median channel's): {len(flagged)} of {len(weights)}"]
    for w in flagged:
        shown = ", ".join(map(str, w.outliers[:8])) + (", ..." if len(w.outliers) > 8 else "")
        line = f"  {w.param} ({w.spec}): channel(s) {shown} up to {w.outlier_ratio:.1f}x the median"
        if w.median_levels is not None:
            line += f"; the median channel uses {w.median_levels:g} of {w.levels} levels"
        lines.append(line)
    return lines


def _advice(advice) -> list[str]:
    if not advice:
        return []
    lines = ["Advice (put the rule first; measured: outputs vs float with simulate)"]
    rows = []
    for a in advice:
        m = a.measured
        rows.append([a.edge, a.module_path or "''", a.change,
                     "-" if m is None else f"{m.gain_db:+.1f}",
                     "-" if m is None else db(m.output_sqnr_db),
                     "-" if m is None or m.size_delta_bytes is None else f"{m.size_delta_bytes:+d} B",
                     a.why])
    lines.append(table(["edge", "module", "change", "gain dB", "outputs dB", "size", "why"], rows))
    return lines


def _float_ops(rows) -> list[str]:
    if not rows:
        return []
    islands = sum(r.count for r in rows if r.kind == "island")
    conversions = sum(r.count for r in rows if r.kind == "conversion")
    out = [f"Float islands ({islands} LiteRT ops) and conversions ({conversions})"]
    out += [f"  {r.kind:<10}  {r.op}{f' x{r.count}' if r.count > 1 else ''}  "
            f"(module {r.module_path or '(top)'!r}): {r.why}" for r in rows]
    return out
