"""The compare report as one self-contained HTML page (internal).

`render_html(json.loads(report.to_json()))` returns a page whose CSS and plots
are inline (SVG drawn here: no matplotlib, no script, nothing fetched), so it
opens offline and can be attached to a bug as one file.

Sharp edges:
  - It reads the JSON, not a `Report`. Keys that format version 1 lacks
    (`runs`, `index`, `who`, `hist`, `weights`, `advice`, `notes`) are drawn
    when present; a section whose key is absent is left out, a cell reads "-".
  - SQNR `null` is inf (no error) and -999 is -inf, as the JSON writes them;
    a NaN breaks a line and reads "nan".
  - Every string from the report (module paths, edge names, notes, advice) is
    escaped: a module path is text, never markup.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence

from odmlq.report._svg import _axes, _e, _Frame, _legend, _line, _svg, _tick_text, _ticks

__all__ = ["render_html"]

_RUN_ORDER = ("local", "simulate", "xla", "litert", "device")
_BACKEND_RUNS = ("xla", "litert", "device")
_RUN_COLOURS = {"local": "#e66101", "simulate": "#2c7bb6", "xla": "#7b3294", "litert": "#1a9641",
                "device": "#a6611a"}
_OTHER_COLOURS = ("#525252", "#c51b7d", "#01665e", "#8c510a")
_RUN_MEANINGS = {"local": "this op on float inputs (the error it introduces)",
                 "simulate": "everything quantized (the error it carries)",
                 "xla": "the XLA quantized model", "litert": "the LiteRT interpreter",
                 "device": "the model on the device"}
_TABLE_ROWS = 25      # hundreds of edges: the worst ones first, the rest folded
_LABEL_GAP = 15.0     # px between neighbouring slanted x labels (11 px text)
_CHAR_PX = 6.2        # width of an 11 px character, about
_HISTOGRAM_EDGES = 6
_WEIGHT_PLOTS = 12    # params with outliers first
_WEIGHT_BARS = 256    # more channels than this share bars (min of mins, max of maxes)
_MINUS_INF_DB = -999.0  # the JSON has no -Infinity: an SQNR of -inf is written as this
_OUTLIER, _CHANNEL = "#d7191c", "#2c7bb6"
_FONT = 'system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",Arial,sans-serif'
_CSS = f"""
*{{box-sizing:border-box}} body{{margin:0;background:#f3f5f8;color:#1f2328;font:14px/1.45 {_FONT}}}
main{{max-width:1180px;margin:0 auto;padding:20px 24px 32px}}
h1{{font-size:24px;margin:4px 0 2px}} h2{{font-size:17px;margin:0 0 4px}}
h3{{font-size:13px;margin:0 0 2px;font-weight:600;overflow-wrap:anywhere}}
section{{background:#fff;border:1px solid #d8dee4;border-radius:8px;padding:16px 20px;margin:14px 0}}
p{{margin:4px 0 10px}} .muted{{color:#656d76}} .small{{font-size:12px}}
.cards{{display:flex;flex-wrap:wrap;gap:10px;margin:10px 0 4px}}
.card{{border:1px solid #d8dee4;border-radius:6px;padding:6px 14px;min-width:130px;background:#fafbfc}}
.card span{{display:block;font-size:12px;color:#656d76}}
.card b{{display:block;font-size:19px;font-variant-numeric:tabular-nums}}
.scroll{{overflow:auto;max-height:80vh}} table{{border-collapse:collapse;width:100%;font-size:12.5px}}
th{{text-align:left;font-weight:600;border-bottom:2px solid #d8dee4;padding:5px 6px;white-space:nowrap;
position:sticky;top:0;background:#fff;z-index:1}}
td{{padding:4px 6px;border-bottom:1px solid #edf0f3;vertical-align:top}}
td.name{{overflow-wrap:anywhere;min-width:120px;max-width:260px}} td.name span{{display:block;color:#656d76}}
td.spec{{font-size:12px;min-width:110px;max-width:190px}}
details>summary{{cursor:pointer;color:#0969da;margin:8px 0}}
td.num,th.num{{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}}
td.code{{font-family:ui-monospace,"DejaVu Sans Mono",Menlo,monospace;font-size:12px}}
td.bad{{color:{_OUTLIER};font-weight:600}} td.good{{color:#1a7f37;font-weight:600}} .who-local{{font-weight:600}}
.who-inherited{{color:#656d76}} .who-shared{{font-style:italic}}
.grid{{display:grid;grid-template-columns:repeat(auto-fill,minmax(350px,1fr));gap:14px 18px}}
svg{{display:block;max-width:100%;height:auto}} svg text{{font:11px {_FONT};fill:#3d444d}}
svg text.band{{fill:#8c959f;font-style:italic}}
ul{{margin:4px 0;padding-left:20px}} footer{{font-size:12px;color:#656d76}}
"""


def render_html(data: dict, *, title: str = "odmlq report") -> str:
    """The report (`json.loads(report.to_json())`) as one HTML page.

    Args:
      data: The report's JSON data.
      title: The page title and heading.

    Returns:
      The page: HTML with inline CSS and SVG, no external resources.

    Example:
      >>> page = render_html(json.loads(report.to_json()), title="digits cnn int8")
      >>> pathlib.Path("report.html").write_text(page, encoding="utf-8")
    """
    edges = [e for e in data.get("edges") or [] if isinstance(e, dict)]
    runs = _runs(data, edges)
    sections = [_summary(data, edges, runs, title), _sqnr_section(edges, runs), _edge_table(edges, runs),
                _advice(data["advice"]) if "advice" in data else "",
                _float_ops(data["float_ops"], "litert" in runs) if "float_ops" in data else "",
                _histograms(edges, runs), _weights(data["weights"]) if "weights" in data else "",
                _details(data)]
    footer = f'<footer>{_e(data.get("format"))} version {_e(data.get("version"))}, drawn by odmlq</footer>'
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width,initial-scale=1">'
            f"<title>{_e(title)}</title><style>{_CSS}</style></head>"
            f'<body><main>{"".join(sections)}{footer}</main></body></html>\n')


# --- reading the data ------------------------------------------------------

def _runs(data: dict, edges: Sequence[dict]) -> list[str]:
    """Run names: the listed ones, then any others the edges have."""
    seen = {r for e in edges for r in (e.get("runs") or {})}
    listed = [str(r) for r in data.get("runs") or []]
    known = [r for r in _RUN_ORDER if r in seen and r not in listed]
    return listed + known + sorted(seen - set(listed) - set(known))


def _colour(run: str, runs: Sequence[str]) -> str:
    others = [r for r in runs if r not in _RUN_COLOURS]
    return _RUN_COLOURS.get(run) or _OTHER_COLOURS[others.index(run) % len(_OTHER_COLOURS)]


def _metrics(edge: dict, run: str) -> dict | None:
    m = (edge.get("runs") or {}).get(run)
    return m if isinstance(m, dict) else None


def _sqnr(metrics: dict | None, key: str = "sqnr_db") -> float | None:
    """dB: inf for null (no error), -inf for -999; None when there are no metrics."""
    if metrics is None:
        return None
    value = metrics.get(key)
    return math.inf if value is None else -math.inf if value <= _MINUS_INF_DB else float(value)


def _db(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}" if math.isfinite(value) else str(value)


def _number(value: object, form: str) -> str:
    """`value` in `form`; a float of 100,000 or more in 3 significant digits
    (an edge whose range collapsed is off by ~1e38 LSB: no wider than any other)."""
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, float) and abs(value) >= 1e5 and form.endswith("f"):
        return format(value, ".3g")
    return format(value, form)


def _fill(db: float | None) -> str:
    """Background by SQNR: red at 0 dB to green at 40 dB (int8 at its best) and above."""
    if db is None or math.isnan(db):
        return "#eceff2"
    t = min(max(db / 40.0, 0.0), 1.0)
    return f"hsl({round(120 * t)},70%,{86 - 4 * (1 - t):.0f}%)"


# --- sections --------------------------------------------------------------

def _section(section_id: str, heading: str, intro: str, body: str = "") -> str:
    intro = f'<p class="muted">{intro}</p>' if intro else ""
    return f'<section id="{section_id}"><h2>{_e(heading)}</h2>{intro}{body}</section>'


def _td(text: str, cls: str = "num", style: str = "", title: str = "") -> str:
    """A cell; `text` is already escaped."""
    style = f' style="{style}"' if style else ""
    title = f' title="{_e(title)}"' if title else ""
    return f'<td class="{cls}"{style}{title}>{text}</td>'


def _table(heads: Sequence[str], numeric: Iterable[int], rows: Sequence[Sequence[str]]) -> str:
    numeric = set(numeric)
    head = "".join(f'<th class="{"num" if i in numeric else ""}">{_e(h)}</th>' for i, h in enumerate(heads))
    body = "".join(f"<tr>{''.join(cells)}</tr>" for cells in rows)
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _card(label: str, value: str, note: str = "", fill: str = "") -> str:
    style = f' style="background:{fill}"' if fill else ""
    return f'<div class="card"{style}><span>{_e(label)}</span><b>{_e(value)}</b><span>{_e(note)}</span></div>'


def _summary(data: dict, edges: Sequence[dict], runs: Sequence[str], title: str) -> str:
    cards = [_card(f"{label} vs float", f"{_db(_sqnr(m))} dB",
                   "output SQNR" + (f", {m['nan']} NaN" if m.get("nan") else ""), _fill(_sqnr(m)))
             for label, m in (data.get("outputs") or {}).items() if isinstance(m, dict)]
    quantized = sum(1 for e in edges if e.get("spec") not in (None, "float"))
    cards.append(_card("edges", f"{len(edges)}", f"{quantized} quantized"))
    if edges and runs:
        db = _sqnr(_metrics(edges[0], runs[0]))
        cards.append(_card("worst edge", str(edges[0].get("edge")), f"{runs[0]} {_db(db)} dB", _fill(db)))
    meanings = "; ".join(f"<b>{_e(r)}</b>: {_e(_RUN_MEANINGS.get(r, 'a run'))}" for r in runs)
    items = [_e(n) for n in data.get("notes") or []]
    notes = f'<ul id="notes">{"".join(f"<li>{n}</li>" for n in items)}</ul>' if items else ""
    return (f'<header id="summary"><h1>{_e(title)}</h1><p class="muted">Each run against float, '
            f'edge by edge. {meanings}.</p><div class="cards">{"".join(cards)}</div>{notes}</header>')


def _edge_table(edges: Sequence[dict], runs: Sequence[str]) -> str:
    backends = [r for r in runs if r in _BACKEND_RUNS]
    heads = (["#", "edge (module)", "spec"] + [f"{r} dB" for r in runs] + ["max LSB", "clipped", "NaN"]
             + [f"{r}-sim LSB" for r in backends] + ["who"])
    rows = [_edge_row(rank, e, runs, backends) for rank, e in enumerate(edges, 1)]
    numeric = [i for i in range(len(heads)) if i == 0 or 3 <= i < len(heads) - 1]
    body = _table(heads, numeric, rows[:_TABLE_ROWS])
    if len(rows) > _TABLE_ROWS:
        body += (f'<details id="more-edges"><summary>{len(rows) - _TABLE_ROWS} more edges</summary>'
                 f"{_table(heads, numeric, rows[_TABLE_ROWS:])}</details>")
    intro = ("Worst local SQNR first: the top is where accuracy is lost, not where it is noticed. max LSB "
             "and clipped are of the simulate run (hover a simulate cell for its cosine and max abs); "
             + ("<i>backend</i>-sim LSB: the largest difference from simulate; " if backends else "")
             + "who: the edge introduces most of its error (local) or receives it (inherited).")
    return _section("edges", "Edges, worst first", intro, body)


def _edge_row(rank: int, e: dict, runs: Sequence[str], backends: Sequence[str]) -> list[str]:
    sim = _metrics(e, "simulate") or {}
    nans = {r: (_metrics(e, r) or {}).get("nan") or 0 for r in runs}
    clipped, who = sim.get("clipped"), str(e.get("who") or "-")
    name = f'{_e(e.get("edge"))}<span>{_e(e.get("module_path") or "(top)")}</span>'
    cells = [_td(str(rank)), _td(name, "code name"), _td(_e(e.get("spec")), "spec")]
    detail = f"cosine {_number(sim.get('cosine'), '.5f')}, max abs {_number(sim.get('max_abs'), '.3g')}"
    cells += [_td(_db(db), style=f"background:{_fill(db)}", title=detail if r == "simulate" else "")
              for r, db in ((r, _sqnr(_metrics(e, r))) for r in runs)]
    cells += [_td(_number(sim.get("lsb"), ".1f")),
              _td("-" if clipped is None else _number(100 * clipped, ".2f") + "%"),
              _td(str(sum(nans.values())) if any(nans.values()) else "-", "num bad" if any(nans.values())
                  else "num", title=", ".join(f"{r}: {n}" for r, n in nans.items()))]
    cells += [_td(_number((_metrics(e, r) or {}).get("simulate_lsb"), ".1f")) for r in backends]
    return cells + [_td(_e(who), f"who-{_e(who)}")]


def _float_ops(rows: Sequence[dict], litert: bool) -> str:
    islands = sum(int(r.get("count", 1)) for r in rows if r.get("kind") == "island")
    conversions = sum(int(r.get("count", 1)) for r in rows if r.get("kind") == "conversion")
    heading = (f"Float islands ({islands}) and conversions ({conversions})" if litert
               else f"Conversions ({conversions})")
    unknown = "" if litert else "No .tflite was compared, so its float islands are not known (compare(tflite=...)). "
    if not rows:
        return _section("float-ops", heading, unknown + "No conversion: every quantized op reads its inputs "
                        "in its own type.")
    table = _table(["kind", "op or edge", "count", "module", "why"], [2], [
        [_td(_e(r.get("kind")), ""), _td(_e(r.get("op")), "code name"), _td(str(r.get("count", 1))),
         _td(_e(r.get("module_path") or "(top)"), "code name"), _td(_e(r.get("why")), "")] for r in rows])
    return _section("float-ops", heading, unknown + "Islands: LiteRT ops that compute in float inside the integer graph "
                    "(a QUANTIZE/DEQUANTIZE pair around each), with the reason. Conversions: an edge "
                    "requantized for ops that read it in another type (one QUANTIZE each).", table)


def _details(data: dict) -> str:
    """What a reader rarely needs, folded: tensors no plan edge names, the format."""
    items = []
    if data.get("unmapped_tensors"):
        items.append("LiteRT tensors with no plan edge (the converter's own, or merged away): "
                     + _e(", ".join(map(str, data["unmapped_tensors"]))))
    items.append(f"{_e(data.get('format'))} version {_e(data.get('version'))}")
    listing = "".join(f"<li>{i}</li>" for i in items)
    return (f'<section id="details"><details><summary>Details</summary>'
            f'<ul id="detail-list">{listing}</ul></details></section>')


def _advice(advice: Sequence[dict]) -> str:
    if not advice:
        return _section("advice", "Advice", "No advice: no edge is worth a change of rules.")
    heads = ["edge", "module", "change", "rule", "why", "output dB", "gain dB", "size", "Δ size"]
    rows = []
    for a in advice:
        rule = a.get("rule")
        rule_text = (", ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in rule.items())
                     if isinstance(rule, dict) else rule)
        cells = [_td(_e(a.get("edge")), "code name"), _td(_e(a.get("module_path") or "(top)"), "code name"),
                 _td(_e(a.get("change")), ""), _td(_e(rule_text), "code name"), _td(_e(a.get("why")), "small")]
        m = a.get("measured")
        if isinstance(m, dict):
            out, gain, litert = (_sqnr(m, k) for k in ("output_sqnr_db", "gain_db", "litert_output_sqnr_db"))
            tip = f"LiteRT re-export: {_db(litert)} dB" if m.get("litert_output_sqnr_db") is not None else ""
            cells += [_td(_db(out), style=f"background:{_fill(out)}", title=tip),
                      _td(("+" if gain > 0 else "") + _db(gain), "num good" if gain > 0 else "num bad"),
                      _td(_number(m.get("size_bytes"), ",.0f")), _td(_number(m.get("size_delta_bytes"), "+,.0f"))]
        else:
            cells.append('<td class="muted" colspan="4">not measured</td>')
        rows.append(cells)
    return _section("advice", "Advice", "Rules to put first, each measured by re-running the model with it: "
                    "outputs vs float, the gain over the current rules, and the size of the re-exported "
                    ".tflite in bytes.", _table(heads, range(5, 9), rows))


def _sqnr_section(edges: Sequence[dict], runs: Sequence[str]) -> str:
    if not edges:
        return _section("network", "SQNR along the network", "No edges in this report.")
    indexed = all(isinstance(e.get("index"), int) for e in edges)
    ordered = sorted(edges, key=lambda e: e["index"]) if indexed else edges
    intro = "Edges in execution order" if indexed else "Edges in the report's order (it has no execution index)"
    intro += "; higher is better; ▲ on the dashed line: no error (inf). Hover for values."
    return _section("network", "SQNR along the network", intro, _sqnr_plot(ordered, runs))


def _histograms(edges: Sequence[dict], runs: Sequence[str]) -> str:
    chosen = [(rank, e) for rank, e in enumerate(edges, 1)
              if any(_histogram(_metrics(e, r)) for r in runs)][:_HISTOGRAM_EDGES]
    if not chosen:
        return ""
    plots = "".join(f'<div><h3>#{rank} {_e(e.get("edge"))} <span class="muted">'
                    f'{_e(e.get("module_path"))}</span></h3>{_histogram_plot(e, runs)}</div>'
                    for rank, e in chosen)
    return _section("histograms", f"Error histograms, {len(chosen)} worst edges",
                    "Run minus float, count per bin on a log scale: a narrow peak is rounding, "
                    "far bars are clipping or outliers.", f'<div class="grid">{plots}</div>')


def _weights(weights: Sequence[dict]) -> str:
    if not weights:
        return _section("weights", "Weight ranges per channel", "No weight statistics in this report.")
    ranked = sorted(weights, key=lambda w: -len(w.get("outliers") or []))[:_WEIGHT_PLOTS]
    plots = "".join(f'<div><h3>{_e(w.get("param"))} <span class="muted">{_e(w.get("spec"))}'
                    f' · {_e(_channels(w))}</span></h3>{_weight_plot(w)}</div>' for w in ranked)
    more = (f'<p class="muted small">{len(weights) - len(ranked)} more params not shown.</p>'
            if len(weights) > len(ranked) else "")
    return _section("weights", "Weight ranges per channel",
                    "Min to max of each channel; red: an outlier channel (abs max far above the median "
                    "channel's) that stretches a shared scale. Params with outliers first.",
                    f'<div class="grid">{plots}</div>{more}')


def _channels(weight: dict) -> str:
    axis = weight.get("axis")
    text = "one channel" if axis is None else f"axis {axis}"
    if weight.get("median_levels") is not None and weight.get("levels"):
        text += f" · median channel uses {weight['median_levels']:.0f} of {weight['levels']} levels"
    return text


def _sqnr_plot(edges: Sequence[dict], runs: Sequence[str]) -> str:
    values = {r: [_sqnr(_metrics(e, r)) for e in edges] for r in runs}
    every = [v for vs in values.values() for v in vs if v is not None]
    finite = [v for v in every if math.isfinite(v)]
    lo = min(0.0, 10 * math.floor(min(finite) / 10)) if finite else 0.0
    hi = 10 * math.ceil(max(finite) / 10 + 1e-9) if finite else 60.0
    # inf and -inf are drawn on dashed lines of their own, beyond the ticks.
    clip = {math.inf: hi + 0.08 * (hi - lo), -math.inf: lo - 0.08 * (hi - lo)}
    low = clip[-math.inf] if -math.inf in every else lo
    # The end of an edge's name says what it is (…/attention/self/softmax).
    labels = [s if len(s) <= 30 else "…" + s[-29:] for s in (str(e.get("edge")) for e in edges)]
    bottom = 16 + 0.65 * _CHAR_PX * max(len(s) for s in labels)  # labels slant at 40 degrees
    n = len(edges)
    f = _Frame(width=1090, height=300 + bottom, x=(-0.5, n - 0.5), y=(low, clip[math.inf]),
               margin=(28, 16, bottom, 52))
    xticks = [(i, _fitting(labels[i], f.px(i))) for i in _labelled(values, f, n)]
    limits = [(clip[math.inf], "inf")] + ([(low, "−inf")] if low < lo else [])
    body = (_axes(f, [(t, _tick_text(t)) for t in _ticks(lo, hi, 6)] + limits, "SQNR (dB)", xticks, "",
                  rotate=True) + _module_bands(f, edges))
    body += [f'<line x1="{f.margin[3]}" x2="{f.width - f.margin[1]}" y1="{f.py(y)}" y2="{f.py(y)}" '
             'stroke="#8c959f" stroke-dasharray="4 3"/>' for y, _ in limits]
    for r in runs:
        tips = [f"{label} ({e.get('module_path') or 'top'}): {r} {_db(v)} dB"
                for label, e, v in zip(labels, edges, values[r])]
        body += _line(f, [None if v is None or math.isnan(v) else clip.get(v, v) for v in values[r]],
                      _colour(r, runs), tips, [v if v in clip else 0 for v in values[r]])
    body.append(_legend(f, [(r, _colour(r, runs)) for r in runs]))
    return _svg(f, "sqnr", "SQNR along the network, one line per run", body)


def _fitting(label: str, x: float) -> str:
    """`label`, cut at its start so that slanted down-left from `x` it stays in the plot's box."""
    # The box of a slanted line reaches its length's run plus its height's rise
    # left of the anchor; 7 px is a wide character of the 11 px font.
    room = int((x - 4 - 11 * math.sin(math.radians(40))) / (7.0 * math.cos(math.radians(40))))
    return label if len(label) <= room else "…" + label[-max(room - 1, 1):]


def _labelled(values: dict[str, list], f: _Frame, n: int) -> list[int]:
    """The edges whose x labels are drawn: worst SQNR first, each kept only if
    it is `_LABEL_GAP` px (across the 40-degree slant) from every kept one, so
    that no two labels overlap at any number of edges."""
    slot = (f.px(1) - f.px(0)) * math.sin(math.radians(40))
    step = max(1, math.ceil(_LABEL_GAP / slot)) if slot > 0 else 1

    def worst(i: int) -> float:
        seen = [v[i] for v in values.values() if v[i] is not None and not math.isnan(v[i])]
        return min(seen, default=math.inf)

    kept: list[int] = []
    for i in sorted(range(n), key=lambda i: (worst(i), i)):
        if all(abs(i - j) >= step for j in kept):
            kept.append(i)
    return sorted(kept)


def _module_bands(f: _Frame, edges: Sequence[dict]) -> list[str]:
    """Alternate shading behind consecutive edges of one module, named where it fits."""
    out, start, shade = [], 0, False
    for i in range(1, len(edges) + 1):
        if i < len(edges) and edges[i].get("module_path") == edges[start].get("module_path"):
            continue
        x0, x1 = f.px(start - 0.5), f.px(i - 0.5)
        name = str(edges[start].get("module_path") or "(top)")
        out.append(f'<rect x="{x0}" y="{f.margin[0]}" width="{round(x1 - x0, 2)}" '
                   f'height="{f.height - f.margin[0] - f.margin[2]}" fill="{"#edf1f5" if shade else "#fbfcfd"}">'
                   f"<title>module {_e(name)}</title></rect>")
        if x1 - x0 > 6.5 * len(name) + 8:
            out.append(f'<text x="{(x0 + x1) / 2}" y="{f.margin[0] + 12}" text-anchor="middle" '
                       f'class="band">{_e(name)}</text>')
        start, shade = i, not shade
    return out


def _histogram(metrics: dict | None) -> dict | None:
    h = (metrics or {}).get("hist")
    ok = isinstance(h, dict) and h.get("counts") and all(isinstance(h.get(k), (int, float)) for k in ("lo", "hi"))
    return h if ok else None


def _histogram_plot(edge: dict, runs: Sequence[str]) -> str:
    hists = {r: h for r in runs if (h := _histogram(_metrics(edge, r)))}
    lo, hi = min(h["lo"] for h in hists.values()), max(h["hi"] for h in hists.values())
    top = math.log10(max(1, *(max(h["counts"]) for h in hists.values()))) + 0.15
    # Log counts: a count of 1 (log 0) still shows as a bar above the base at -0.3.
    f = _Frame(width=370, height=200, x=(lo, hi if hi > lo else lo + 1), y=(-0.3, top))
    unit = "LSB" if next(iter(hists.values())).get("unit") == "LSB" else "abs"
    powers = [(float(k), ("1", "10", "100", "1k", "10k", "100k")[k] if k < 6 else f"1e{k}")
              for k in range(0, math.floor(top) + 1)]
    body = _axes(f, powers, "count",
                 [(t, _tick_text(t)) for t in _ticks(lo, hi, 5)], f"run − float ({unit})")
    base, outlines = f.py(-0.3), []
    for r, h in hists.items():
        counts, colour = h["counts"], _colour(r, runs)
        width, outline = (h["hi"] - h["lo"]) / len(counts), []
        for i, c in enumerate(counts):
            a = h["lo"] + i * width
            x0, x1, y = f.px(a), f.px(a + width), f.py(math.log10(c)) if c else base
            outline += [f"{x0},{y}", f"{x1},{y}"]
            if c:
                body.append(f'<rect x="{x0}" y="{y}" width="{max(round(x1 - x0, 2), 0.8)}" '
                            f'height="{round(base - y, 2)}" fill="{colour}" fill-opacity="0.18">'
                            f"<title>{_e(r)}: [{a:.4g}, {a + width:.4g}): {c}</title></rect>")
        outlines.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.6" points="{" ".join(outline)}"/>')
    body += outlines  # over every run's bars, so that none hides another
    body.append(_legend(f, [(r, _colour(r, runs)) for r in hists]))
    return _svg(f, "histogram", f"error histogram of {edge.get('edge')}", body)


def _weight_plot(weight: dict) -> str:
    lows, highs = list(weight.get("min") or []), list(weight.get("max") or [])
    n = min(len(lows), len(highs))
    if not n:
        return '<p class="muted small">no channels</p>'
    outliers = {int(c) for c in weight.get("outliers") or []}
    group = math.ceil(n / _WEIGHT_BARS)
    bars = [(c, min(c + group, n)) for c in range(0, n, group)]
    lo, hi = min(0.0, min(lows[:n])), max(0.0, max(highs[:n]))
    ticks, pad = _ticks(lo, hi, 5), 0.05 * (hi - lo)
    f = _Frame(width=370, height=190, x=(-0.5, len(bars) - 0.5),
               y=(min(lo - pad, ticks[0]), max(hi + pad, ticks[-1])), margin=(26, 10, 36, 50))
    body = _axes(f, [(t, _tick_text(t)) for t in ticks], "value",
                 [(t / group, _tick_text(t)) for t in _ticks(0, n - 1, 6) if t == int(t)], "channel")
    slot = (f.width - f.margin[1] - f.margin[3]) / len(bars)
    for k, (c0, c1) in enumerate(bars):
        bad = [c for c in range(c0, c1) if c in outliers]
        y0, y1 = f.py(max(highs[c0:c1])), f.py(min(lows[c0:c1]))
        name = f"channel {c0}" if c1 == c0 + 1 else f"channels {c0}-{c1 - 1}"
        body.append(f'<rect x="{round(f.px(k) - 0.35 * slot, 2)}" y="{y0}" width="{max(round(0.7 * slot, 2), 0.8)}" '
                    f'height="{max(round(y1 - y0, 2), 0.8)}" fill="{_OUTLIER if bad else _CHANNEL}" '
                    f'class="{"outlier" if bad else "channel"}"><title>{name}: [{min(lows[c0:c1]):.4g}, '
                    f'{max(highs[c0:c1]):.4g}]{" outlier " + str(bad) if bad else ""}</title></rect>')
    body.append(f'<line x1="{f.margin[3]}" x2="{f.width - f.margin[1]}" y1="{f.py(0)}" y2="{f.py(0)}" '
                'stroke="#8c959f"/>')
    body.append(_legend(f, [("channel", _CHANNEL)] + ([("outlier", _OUTLIER)] if outliers else [])))
    return _svg(f, "weights", f"per-channel range of {weight.get('param')}", body)
