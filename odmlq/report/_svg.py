"""Small SVG plotting pieces for the HTML report (internal): a frame mapping
data to pixels, axes with ticks, a legend, a broken polyline with tooltips.
Every text is escaped."""

from __future__ import annotations

import dataclasses
import html
import math
from collections.abc import Iterable, Sequence


def _e(value: object) -> str:
    return html.escape("" if value is None else str(value), quote=True)


@dataclasses.dataclass(frozen=True)
class _Frame:
    """A plot: data ranges `x` and `y` mapped to pixels inside the margins."""

    width: float
    height: float
    x: tuple[float, float]
    y: tuple[float, float]
    margin: tuple[float, float, float, float] = (26, 10, 36, 48)  # top, right, bottom, left

    def px(self, x: float) -> float:
        left, right = self.margin[3], self.width - self.margin[1]
        return round(left + (x - self.x[0]) / ((self.x[1] - self.x[0]) or 1.0) * (right - left), 2)

    def py(self, y: float) -> float:
        top, bottom = self.margin[0], self.height - self.margin[2]
        return round(bottom - (y - self.y[0]) / ((self.y[1] - self.y[0]) or 1.0) * (bottom - top), 2)


def _svg(f: _Frame, name: str, label: str, body: Iterable[str]) -> str:
    return (f'<svg class="plot" data-plot="{_e(name)}" xmlns="http://www.w3.org/2000/svg" width="{f.width}" '
            f'height="{f.height}" viewBox="0 0 {f.width} {f.height}" role="img" aria-label="{_e(label)}">'
            f'{"".join(body)}</svg>')


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round numbers (1, 2 or 5 times a power of ten) in [lo, hi]."""
    if not hi > lo:
        return [lo]
    step = 10 ** math.floor(math.log10((hi - lo) / count))
    step *= next(m for m in (1, 2, 5, 10) if (hi - lo) / (step * m) <= count)
    return [round(i * step, 10) for i in range(math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9) + 1)]


def _tick_text(value: float) -> str:
    return f"{value:.4g}".replace("-", "−") if value else "0"


def _axes(f: _Frame, yticks: Sequence[tuple[float, str]], ylabel: str,
          xticks: Sequence[tuple[float, str]], xlabel: str, rotate: bool = False) -> list[str]:
    """The plot area, grid lines at the y ticks, tick labels, the axis titles."""
    top, right, bottom, left = f.margin
    x1, base = f.width - right, f.height - bottom
    out = [f'<rect x="{left}" y="{top}" width="{x1 - left}" height="{base - top}" fill="#fbfcfd" stroke="#d8dee4"/>']
    for value, text in yticks:
        y = f.py(value)
        out.append(f'<line x1="{left}" x2="{x1}" y1="{y}" y2="{y}" stroke="#e6e9ed"/>'
                   f'<text x="{left - 5}" y="{y + 3.5}" text-anchor="end">{_e(text)}</text>')
    for value, text in xticks:
        x = f.px(value)
        out.append(f'<line x1="{x}" x2="{x}" y1="{base}" y2="{base + 4}" stroke="#8c959f"/>')
        out.append(f'<text transform="translate({x + 3},{base + 8}) rotate(-40)" text-anchor="end">{_e(text)}</text>'
                   if rotate else f'<text x="{x}" y="{base + 16}" text-anchor="middle">{_e(text)}</text>')
    if xlabel:
        out.append(f'<text x="{(left + x1) / 2}" y="{f.height - 4}" text-anchor="middle">{_e(xlabel)}</text>')
    out.append(f'<text transform="translate(12,{(top + base) / 2}) rotate(-90)" text-anchor="middle">'
               f"{_e(ylabel)}</text>")
    return out


def _legend(f: _Frame, items: Sequence[tuple[str, str]]) -> str:
    """Swatches and names in a row, right-aligned above the plot area."""
    widths = [24 + 6.5 * len(name) for name, _ in items]
    x, out = f.width - f.margin[1] - sum(widths), []
    for (name, colour), w in zip(items, widths):
        out.append(f'<rect x="{x:.1f}" y="6" width="12" height="12" rx="2" fill="{colour}"/>'
                   f'<text x="{x + 16:.1f}" y="16">{_e(name)}</text>')
        x += w
    return "".join(out)


def _line(f: _Frame, ys: Sequence[float | None], colour: str, tips: Sequence[str],
          beyond: Sequence[float]) -> list[str]:
    """A polyline through x = 0, 1, ..., broken at None, and markers with tooltips.

    A point whose `beyond` is inf or -inf is a triangle pointing that way.
    """
    points = [None if y is None else (f.px(i), f.py(y)) for i, y in enumerate(ys)]
    segments: list[list[tuple[float, float]]] = [[]]
    for p in points:
        if p is None:
            segments.append([])
        else:
            segments[-1].append(p)
    out = [f'<polyline fill="none" stroke="{colour}" stroke-width="2" stroke-linejoin="round" '
            f'points="{" ".join(f"{x},{y}" for x, y in s)}"/>' for s in segments if s]
    for p, tip, side in zip(points, tips, beyond):
        if p is None:
            continue
        (x, y), title = p, f"<title>{_e(tip)}</title>"
        if side:
            d = f"M{x},{y - 6}l5.5,9h-11z" if side > 0 else f"M{x},{y + 6}l5.5,-9h-11z"
            out.append(f'<path d="{d}" fill="{colour}">{title}</path>')
        else:
            out.append(f'<circle cx="{x}" cy="{y}" r="3.5" fill="{colour}" stroke="#fff">{title}</circle>')
    return out
